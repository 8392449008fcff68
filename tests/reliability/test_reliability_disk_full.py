"""A full disk is named as one: a golden mismatch whose ``.obtained.json`` (and report) cannot be
written says which file and "no space left on device", not "the scenario crashed: OSError"; the
golden stays as it was and no temporary file is left (ENOSPC simulated at the writers' write)."""

from __future__ import annotations

import errno
import json
import os

from reltools import run_args, tree_digest, write_scenario

from rlaudit.errors import EXIT_CHECK_FAILED


def disk_full(monkeypatch) -> None:
    """Every file opened from a descriptor (how the atomic writers write) refuses its write."""
    real = os.fdopen

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)

        def write(*_):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        f.write = write
        return f
    monkeypatch.setattr(os, "fdopen", fdopen)


def test_a_golden_mismatch_on_a_full_disk_names_the_file_and_the_full_disk(cli, tmp_path,
                                                                          monkeypatch):
    scn = tmp_path / "full.yaml"
    write_scenario(scn)
    blessed = cli(*run_args(scn, tmp_path, "--bless"))
    assert (tmp_path / "golden" / "full.json").is_file(), blessed.err[-2000:]

    golden = tmp_path / "golden" / "full.json"
    doc = json.loads(golden.read_text())
    entry = doc["backends"]["reference@cpu"]["steps"][0]["actor/grad_norm"]
    entry["value"] = entry["value"] * 2 + 1          # a hand-edited golden: a mismatch
    golden.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    before = tree_digest(tmp_path / "golden")
    disk_full(monkeypatch)
    res = cli(*run_args(scn, tmp_path))

    assert res.rc == EXIT_CHECK_FAILED, res.err[-2000:]
    obtained = tmp_path / "golden" / "full.obtained.json"
    assert f"could not write {obtained}: no space left on device (ENOSPC)" in res.out, res.out
    assert "crashed" not in res.out, res.out
    assert "Traceback" not in res.out + res.err
    # the report could not be written either: said so, with its file
    assert "could not write the local report" in res.err and "No space left" in res.err, res.err
    assert str(tmp_path / "reports") in res.err
    # nothing half-written: the golden unchanged, no obtained file, no temporary file
    assert tree_digest(tmp_path / "golden") == before
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]
