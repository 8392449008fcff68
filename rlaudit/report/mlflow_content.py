"""What an invocation logs to MLflow, per scenario x backend child run: its params, tags and
metrics (per-step metrics, then the golden comparison rows), and the per-token differences from
the reference backend as a long table (a parquet artifact). rlaudit.report.mlflow_log decides
where and logs them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rlaudit.verdict.result import STATUS_ORDER, ScenarioResult

KIND_TAG, INVOCATION, SCENARIO = "rlaudit.kind", "invocation", "scenario"
#: metric-key prefixes of the golden comparison rows (``golden_drift/actor/pg_loss``)
GOLDEN_PREFIXES = ("golden", "golden_drift", "golden_rtol", "golden_atol")
#: MLflow's limits on key, param-value and tag-value length
MAX_KEY, MAX_PARAM_VALUE, MAX_TAG_VALUE = 250, 6000, 8000
#: cap on token-diff rows per child run (~25 MB of parquet): beyond it variants are left out
MAX_DIFF_ROWS = 2_000_000


def sanitize_key(name: str) -> str:
    """A valid MLflow key: letters, digits, ``_ - . / space`` (``:`` is refused on Windows, so
    replaced too), no empty/``.``/``..`` path segments, at most MAX_KEY characters."""
    key = re.sub(r"[^/\w.\- ]", "_", str(name))
    key = "/".join(s for s in key.split("/") if s not in ("", ".", ".."))
    return key[:MAX_KEY] or "_"


def backend_status(res: ScenarioResult, backend: str) -> dict[str, str]:
    """invariant -> worst status of its checks on ``backend`` (checks on ``*`` apply to all)."""
    out: dict[str, str] = {}
    order = STATUS_ORDER
    for c in res.checks:
        if c.backend not in (backend, "*"):
            continue
        name = "backend" if c.invariant == "*" else c.invariant
        prev = out.get(name)
        if prev is None or order.index(c.status) < order.index(prev):
            out[name] = c.status
    return out


def child_params(res: ScenarioResult, backend: str, git: str | None) -> dict[str, str]:
    params: dict[str, Any] = {"scenario": res.scenario, "backend": backend,
                              "scenario_path": res.path, "dtype": res.dtype, "device": res.device}
    params.update({f"layout.{k}": v for k, v in res.layouts.get(backend, {}).items()})
    params.update({f"provenance.{k}": v for k, v in res.provenance.items()})
    if git:
        params["git_revision"] = git
    for k, v in res.config.items():
        params.setdefault(k, v)
    return {sanitize_key(k): ("None" if v is None else str(v))[:MAX_PARAM_VALUE]
            for k, v in params.items()}


def child_tags(res: ScenarioResult, backend: str, parent_id: str, git: str | None,
               extra: dict[str, Any]) -> dict[str, str]:
    golden = {g.backend: g.status for g in res.golden}
    tags: dict[str, Any] = {**extra, KIND_TAG: SCENARIO, "mlflow.parentRunId": parent_id,
                            "rlaudit.invocation": parent_id, "rlaudit.scenario": res.scenario,
                            "rlaudit.backend": backend, "rlaudit.passed": str(res.passed).lower(),
                            "rlaudit.state": res.state,
                            "rlaudit.tags": ",".join(res.tags),
                            "golden": golden.get(backend, "none")}
    if res.input_error:
        tags["input_error"] = res.input_error
    if git:
        tags["mlflow.source.git.commit"] = git
    for name, status in backend_status(res, backend).items():
        tags[f"invariant.{name}"] = status
    mine = [c for c in res.checks if c.backend in (backend, "*")]
    # checks the release could not run: counted apart, neither failed nor passed
    tags["rlaudit.unsupported"] = sum(c.status == "unsupported" for c in mine)
    for c in mine:
        if c.status in ("fail", "error", "differs", "unsupported") and c.message:
            name = "backend" if c.invariant == "*" else c.invariant
            tags[f"invariant.{name}.message"] = c.message
    if backend in res.errors:
        tags["error"] = res.errors[backend][-MAX_TAG_VALUE:]
    return {sanitize_key(k): str(v)[:MAX_TAG_VALUE] for k, v in tags.items()}


def child_metrics(res: ScenarioResult, backend: str) -> list[tuple[str, float, int]]:
    """(key, value, step): per-step metrics, then the golden rows of this backend."""
    out = []
    for step, metrics in enumerate(res.metrics.get(backend, [])):
        out += [(sanitize_key(k), float(v), step) for k, v in metrics.items() if v is not None]
    for g in res.golden:
        if g.backend != backend:
            continue
        for r in g.rows:
            m = r["metric"]
            for prefix, field in zip(GOLDEN_PREFIXES, ("golden", "drift", "rtol", "atol")):
                if r.get(field) is not None:
                    out.append((sanitize_key(f"{prefix}/{m}"), float(r[field]), int(r["step"])))
    return out


def reference_backend(res: ScenarioResult) -> str | None:
    """The backend token diffs are taken against: ``reference`` when it ran, else the first."""
    ran = [b for b in res.backends if b in res.runs]
    return "reference" if "reference" in ran else (ran[0] if ran else None)


def token_diffs(res: ScenarioResult, backend: str, reference: str, *,
                max_rows: int = MAX_DIFF_ROWS):
    """Long DataFrame (variant, tensor, row, token, value, reference, diff = value - reference)
    over every per-token tensor both backends recorded with the same shape; ``None`` when there
    is nothing to compare. Returns (frame, truncated: some tensors left out over ``max_rows``)."""
    import numpy as np  # lazy: with pandas, only for the per-token parquet artifacts
    import pandas as pd  # lazy: slow to import; only the per-token parquet artifacts need it
    # one frame at the end from concatenated columns: a DataFrame per (variant, tensor) cost
    # 0.2 s per backend and scenario (hundreds of small frames), all of it after the replays
    labels, counts, cols, rows, truncated = [], [], [], 0, False
    mine, theirs = res.runs.get(backend, {}), res.runs.get(reference, {})
    variants = sorted(set(mine) & set(theirs), key=lambda v: (v != "base", v))
    for variant in variants:
        mask = theirs[variant].tokens.get("response_mask")
        for name in sorted(set(mine[variant].tokens) & set(theirs[variant].tokens)):
            a, b = mine[variant].tokens[name], theirs[variant].tokens[name]
            if name == "response_mask" or a.shape != b.shape or a.dim() == 0:
                continue
            a = a.detach().cpu().double().reshape(a.shape[0], -1).numpy()
            b = b.detach().cpu().double().reshape(b.shape[0], -1).numpy()
            if rows + a.size > max_rows:
                truncated = True
                continue
            rows += a.size
            n_rows, n_tok = a.shape
            part = (np.repeat(np.arange(n_rows, dtype=np.int32), n_tok),
                    np.tile(np.arange(n_tok, dtype=np.int32), n_rows),
                    a.ravel(), b.ravel(), (a - b).ravel())
            if mask is not None and tuple(mask.shape) == (n_rows, n_tok):
                keep = mask.reshape(-1).numpy().astype(bool)  # only real response tokens
                part = tuple(col[keep] for col in part)
            labels.append((variant, name))
            counts.append(len(part[0]))
            cols.append(part)
    if not cols:
        return None, truncated
    label = lambda k: pd.Categorical(np.repeat(np.array([x[k] for x in labels], dtype=object),
                                               counts))
    df = pd.DataFrame({"variant": label(0), "tensor": label(1),
                       **{c: np.concatenate([p[k] for p in cols])
                          for k, c in enumerate(("row", "token", "value", "reference", "diff"))}})
    return df, truncated


def write_frame(df, path_stem: Path) -> Path:
    """Parquet when pyarrow/fastparquet is installed, else gzip CSV (mlflow-skinny lacks both)."""
    try:
        path = path_stem.with_suffix(".parquet")
        df.to_parquet(path, index=False)
    except ImportError:
        path = path_stem.with_suffix(".csv.gz")
        df.to_csv(path, index=False)
    return path
