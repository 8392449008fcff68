"""rlaudit.model.hf_import: transformers' model code imported without scikit-learn, in fresh
interpreters -- and a model loaded that way computes what one loaded with scikit-learn does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "scenarios" / "models" / "qwen2-tiny-short"

_LOAD = """
import json, sys, torch
{before}
from rlaudit.model import hf_import
from rlaudit.model.load import load_model
model = load_model({model!r}, dtype=torch.float64)  # its own import_model_code() comes first
hidden = hf_import.SKLEARN_USER in sys.modules and "sklearn" not in sys.modules
ids = torch.arange(1, 13).reshape(2, 6) % model.config.vocab_size
with torch.no_grad():
    logits = model(input_ids=ids).logits
loaded = "sklearn" in sys.modules
never_left_hidden = sys.modules.get("sklearn", 0) is not None
scipy_hidden = hf_import.SCIPY_USER in sys.modules and "scipy" not in sys.modules
scipy_left = sys.modules.get("scipy", 0) is not None
import sklearn.metrics  # importable afterwards
import scipy.optimize
print(json.dumps({{"hidden": hidden, "sklearn_loaded": loaded, "logits": logits.flatten().tolist(),
                  "never_left_hidden": never_left_hidden, "scipy_hidden": scipy_hidden,
                  "scipy_never_left_hidden": scipy_left}}))
"""


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_model_loads_without_sklearn_and_scipy_and_computes_the_same_logits():
    pytest.importorskip("sklearn")
    pytest.importorskip("scipy")
    hidden = _run(_LOAD.format(before="", model=str(MODEL)))
    # the reference logits: transformers has answered "installed" for scikit-learn already (the
    # module imports it, which fails while hidden, so it is imported the usual way) and SciPy is
    # loaded before (nothing to hide: the model code imports it)
    usual = _run(_LOAD.format(before="from transformers.utils import import_utils; "
                                     "import_utils.is_sklearn_available(); import scipy",
                              model=str(MODEL)))
    assert (hidden["hidden"], hidden["sklearn_loaded"]) == (True, False)
    assert (usual["hidden"], usual["sklearn_loaded"]) == (False, True)
    assert hidden["scipy_hidden"] and not usual["scipy_hidden"]
    assert hidden["never_left_hidden"] and usual["never_left_hidden"]
    assert hidden["scipy_never_left_hidden"] and usual["scipy_never_left_hidden"]
    assert hidden["logits"] == usual["logits"]  # bit for bit


_NEEDS_SCIPY = """
import json, sys
sys.path.insert(0, {tmp!r})
import transformers
from rlaudit.model import hf_import
hf_import.SCIPY_USER = "needs_scipy"
hidden = hf_import._import_without_scipy()
from transformers.utils import import_utils
print(json.dumps({{"hidden": hidden, "ok": sys.modules["needs_scipy"].f is not None,
                  "hidden_entry": sys.modules.get("scipy", 0) is None,
                  "answer": import_utils.is_scipy_available(),
                  "asked": sys.modules["needs_scipy"].ASKED}}))
"""


@pytest.mark.slow
def test_a_release_that_needs_scipy_there_gets_it_and_the_true_answer(tmp_path):
    pytest.importorskip("scipy")
    # asks transformers first, as its loss module does, then needs SciPy regardless
    (tmp_path / "needs_scipy.py").write_text(
        "from transformers.utils import is_scipy_available\n"
        "ASKED = is_scipy_available()\n"
        "from scipy.optimize import linear_sum_assignment as f\n")
    got = _run(_NEEDS_SCIPY.format(tmp=str(tmp_path)))
    assert got == {"hidden": False, "ok": True, "hidden_entry": False, "answer": True,
                   "asked": True}


_NEEDS = """
import json, sys
sys.path.insert(0, {tmp!r})
from rlaudit.model import hf_import
hf_import.SKLEARN_USER = "needs_sklearn"
hidden = hf_import.import_model_code()
print(json.dumps({{"hidden": hidden, "ok": sys.modules["needs_sklearn"].roc_curve is not None,
                  "hidden_entry": sys.modules.get("sklearn", 0) is None}}))
"""


@pytest.mark.slow
def test_a_release_that_needs_sklearn_there_gets_it(tmp_path):
    pytest.importorskip("sklearn")
    (tmp_path / "needs_sklearn.py").write_text("from sklearn.metrics import roc_curve\n")
    got = _run(_NEEDS.format(tmp=str(tmp_path)))
    assert got == {"hidden": False, "ok": True, "hidden_entry": False}


_TINY = """
import json, sys
from rlaudit.model import hf_import
from rlaudit.model.tiny import build_tiny_model
build_tiny_model("qwen2", num_hidden_layers=1)
print(json.dumps({"cg": hf_import.SKLEARN_USER in sys.modules, "sklearn": "sklearn" in sys.modules}))
"""


@pytest.mark.slow
def test_tiny_models_are_built_without_sklearn():
    pytest.importorskip("sklearn")
    assert _run(_TINY) == {"cg": True, "sklearn": False}
