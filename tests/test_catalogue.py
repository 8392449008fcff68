"""rlaudit.catalogue: the cached names, docs and availability equal the live registries', the cache
follows the source, and with it `rlaudit list` imports neither torch nor megatron."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlaudit import catalogue
from rlaudit.algo import names as live_names
from rlaudit.errors import UnknownNameError
from rlaudit.scenarios.invariants import INVARIANTS

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAUDIT_CACHE_DIR", str(tmp_path / "cache"))
    catalogue._memo.clear()
    yield tmp_path / "cache"
    catalogue._memo.clear()


def test_cached_catalogue_equals_the_live_registries(fresh_cache):
    first = catalogue.algo_names()            # computed and written
    assert list(fresh_cache.glob("catalogue-*.json"))
    catalogue._memo.clear()
    cached = catalogue.algo_names()           # read back from the file
    for attr in ("ADV_ESTIMATORS", "KL_ESTIMATORS", "POLICY_LOSSES", "AGG_MODES",
                 "DISTILL_LOSSES"):
        live = getattr(live_names, attr)
        assert getattr(cached, attr).names() == getattr(first, attr).names() == live.names()
    assert catalogue.algorithms() == {k: r.names() for k, r in live_names.ALL.items()}
    assert catalogue.invariant_docs() == [
        {"name": n, "family": INVARIANTS.get(n).family, "doc": INVARIANTS.get(n).doc}
        for n in INVARIANTS]
    assert {b["name"] for b in catalogue.backends()} == {"reference", "fsdp", "megatron"}


def test_unknown_names_fail_as_the_registry_would(fresh_cache):
    with pytest.raises(UnknownNameError) as cached:
        catalogue.algo_names().KL_ESTIMATORS.get("k4", source="s.yaml", key="actor.kl_loss_type")
    with pytest.raises(UnknownNameError) as live:
        live_names.KL_ESTIMATORS.get("k4", source="s.yaml", key="actor.kl_loss_type")
    assert str(cached.value) == str(live.value)
    assert cached.value.exit_code == 2 and "low_var_kl" in str(cached.value)
    assert catalogue.invariants().get("backend-parity") == "backend-parity"
    with pytest.raises(UnknownNameError, match="unknown invariant 'backend-parities'"):
        catalogue.invariants().get("backend-parities")


def test_fingerprint_follows_the_source(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "a.py").write_text("x = 1\n")
    catalogue.fingerprint.cache_clear()
    try:
        before = catalogue.fingerprint(root)
        catalogue.fingerprint.cache_clear()
        (root / "a.py").write_text("x = 22\n")          # size and mtime change
        changed = catalogue.fingerprint(root)
        catalogue.fingerprint.cache_clear()
        (root / "b.py").write_text("")                  # a new module
        added = catalogue.fingerprint(root)
    finally:
        catalogue.fingerprint.cache_clear()
    assert len({before, changed, added}) == 3


def test_an_unwritable_cache_directory_only_costs_time(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("RLAUDIT_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    catalogue._memo.clear()
    try:
        assert "grpo" in catalogue.algo_names().ADV_ESTIMATORS
    finally:
        catalogue._memo.clear()


def test_list_imports_neither_torch_nor_megatron_once_cached(tmp_path):
    env = dict(os.environ, RLAUDIT_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    code = ("import json, sys; from rlaudit.cli.main import main; rc = main(['list', '--json']); "
            "print(json.dumps([rc, sorted(m for m in ('torch', 'megatron', 'mlflow') "
            "if m in sys.modules)]))")
    runs = [subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    outs = [r.stdout.strip().splitlines() for r in runs]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    cold, warm = (json.loads(o[-1]) for o in outs)
    assert cold[0] == warm[0] == 0
    assert "torch" in cold[1]          # the first call computed the catalogue
    assert warm[1] == []               # the second read it
    listing = ["\n".join(o[:-1]) for o in outs]
    assert listing[0] == listing[1] and '"invariants"' in listing[1]
    assert "Transformer Engine" not in runs[1].stderr
