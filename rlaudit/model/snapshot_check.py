"""A model snapshot's recorded weights hash, checked before anything runs.

rlaudit's own snapshots (rlaudit/model/tiny.py) record the sha256 of their weights file in
``rlaudit_snapshot.json``; goldens are only meaningful for those exact weights. A weights file
replaced, re-exported or damaged after the snapshot was written would otherwise replay to
different numbers and read as a golden mismatch (or pass against a golden re-blessed on it).
Snapshots without the record (any Hugging Face model) are not checked.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlaudit.errors import InputError
from rlaudit.model.tiny import SNAPSHOT_META, WEIGHTS_FILE, file_sha256

RECORD_KEY = "weights_sha256"


def check_weights_hash(model_dir: str | Path) -> None:
    """InputError when ``model_dir``'s weights do not hash to the recorded ``weights_sha256``."""
    model_dir = Path(model_dir)
    meta_path = model_dir / SNAPSHOT_META
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"not valid JSON: {e}", source=str(meta_path)) from None
    want = meta.get(RECORD_KEY) if isinstance(meta, dict) else None
    if want is None:
        return
    weights = model_dir / WEIGHTS_FILE
    if not isinstance(want, str) or len(want) != 64:
        raise InputError(f"expected the sha256 of {WEIGHTS_FILE} (64 hex digits)",
                         source=str(meta_path), key=RECORD_KEY)
    if not weights.is_file():
        raise InputError(f"{SNAPSHOT_META} records {RECORD_KEY} for {WEIGHTS_FILE}, which is "
                         "missing", source=str(weights))
    got = file_sha256(weights)
    if got != want.lower():
        raise InputError(f"sha256 {got[:16]}... does not match the {RECORD_KEY} "
                         f"{want[:16]}... recorded in {meta_path}: the weights changed after the "
                         "snapshot was written; restore them, or regenerate the snapshot (and "
                         "its goldens)", source=str(weights))
