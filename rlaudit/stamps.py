"""File stamps: what identifies a file's contents without reading it, for in-process memos of
content hashes (a model snapshot's id, a rollout file's sha256) that a run asks for many times."""

from __future__ import annotations

import os
from pathlib import Path


def file_stamps(files) -> tuple:
    """Each file's resolved path, device, inode, size, and modification and change times in ns:
    a rewrite, in place or by rename, changes them."""
    out = []
    for f in files:
        st = os.stat(f)
        out.append((str(Path(f).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                    st.st_ctime_ns))
    return tuple(out)
