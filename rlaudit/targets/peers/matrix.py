"""``make peers-matrix``: the stage checks on every release of every peer that imports on the CPU
environment, as one table: release x check x state, every red linked to its upstream bug or fix.

    python -m rlaudit.targets.peers.matrix                  # reports/peers-matrix.{md,json}
    python -m rlaudit.targets.peers.matrix --only verl      # one peer's releases
    python -m rlaudit.targets.peers.matrix --jobs 1         # one audit at a time

Releases: the pinned ones (``requirements/peers/*.txt``, ``*.git`` commits) and the matrix-only
ones (``requirements/peers-matrix/*.txt``), each installed as ``make peers`` installs
(:mod:`.install`: one ``pip install --no-deps --target`` directory per release, stamped, so a
second run installs nothing). Each release is audited in its own process (releases of one peer
cannot share an interpreter): its adapter loaded as ``--target <peer>==<version>``, every stage
check run (:func:`rlaudit.targets.stages.run_stage_checks`). A release that does not install or
import is a column of its own with the reason, never left out. Reds are matched against
:mod:`.known_reds`; one that matches nothing is listed as untraced.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rlaudit.errors import InputError
from rlaudit.targets.contract.target_errors import one_line
from rlaudit.targets.peers.install import install, pinned_peers
from rlaudit.targets.peers.known_reds import traced, version_key
from rlaudit.targets.peers.registry import PEERS
from rlaudit.targets.peers.snapshots import REQUIREMENTS, pinned_snapshots

#: the matrix-only releases, beside the pinned ones
MATRIX_REQUIREMENTS = REQUIREMENTS.parent / "peers-matrix"
#: seconds one release's stage audit may take (verl's take ~60 s on one core)
AUDIT_TIMEOUT_S = 900
#: the shipped scenarios (the built-in tiny model lives beside them)
SCENARIOS = REQUIREMENTS.parents[1] / "scenarios"
#: characters of a release's load error kept in its cell
MAX_ERROR = 400
#: statuses shown as reds
REDS = ("fail", "error")


@dataclass(frozen=True)
class Release:
    peer: str
    version: str
    requirements: object = None     # an install.Peer, or None for a source snapshot

    @property
    def spec(self) -> str:
        return f"{self.peer}=={self.version}"


def releases(only: list[str] | None = None) -> list[Release]:
    """Every release to audit, by peer then version."""
    out = [Release(p.name, p.version, p) for d in (REQUIREMENTS, MATRIX_REQUIREMENTS)
           if d.is_dir() for p in pinned_peers(d) if p.name in PEERS]
    out += [Release(s.name, s.short) for s in pinned_snapshots() if s.name in PEERS]
    out = [r for r in out if not only or r.peer in only]
    return sorted(set(out), key=lambda r: (r.peer, version_key(r.version)))


def audit_one(spec: str) -> dict:
    """In this process: the stage checks of ``spec``'s adapter (``{"release", "column",
    "checks": {name: {"status", "message"}}}``), or ``{"error": ...}`` when it cannot load."""
    # lazy: loading an adapter imports its peer and torch
    from rlaudit.targets.contract.load import load_adapter
    from rlaudit.targets.stages import run_stage_checks  # lazy: as above
    from rlaudit.targets.inputs.builtin import tiny_model_path  # lazy: as above
    try:
        adapter = load_adapter(spec)
    except (Exception, SystemExit) as e:  # a release that does not import: its own cell
        # the innermost reason (load_adapter wraps the adapter's own InputError)
        text = (str(e) if isinstance(e, InputError) else one_line(e)).split("--target: ")[-1]
        return {"release": spec, "error": text[:MAX_ERROR]}
    # the model train_step's stage checks replay (as `rlaudit run --target` hands them)
    res = run_stage_checks(adapter, model_path=str(tiny_model_path(SCENARIOS)))
    return {"release": spec, "column": res.backends[0], "seconds": round(res.seconds, 1),
            "checks": {c.invariant: {"status": c.status, "message": c.message[:500]}
                       for c in res.checks}}


def audit(release: Release, workdir: Path) -> dict:
    """Install ``release`` (idempotent) and audit it in a child process."""
    if release.requirements is not None:
        try:
            install(release.requirements)
        except (RuntimeError, OSError) as e:
            return {"release": release.spec, "error": f"install failed: {str(e)[-300:]}"}
    out = workdir / f"{release.peer}-{release.version}.json"
    cmd = [sys.executable, "-m", "rlaudit.targets.peers.matrix", "--one", release.spec,
           "--out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=AUDIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"release": release.spec, "error": f"timed out after {AUDIT_TIMEOUT_S} s"}
    if not out.is_file():
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"release": release.spec, "error": f"the audit crashed: {tail[0][:300]}"}
    return json.loads(out.read_text())


def cell(peer: str, version: str, check: str, found: dict) -> str:
    """One table cell: the state, a red linked to its upstream bug (or marked untraced)."""
    c = found.get("checks", {}).get(check)
    if c is None:
        return "-"
    status = c["status"]
    if status not in REDS:
        return status
    red = traced(peer, version, check)
    return f"**{status.upper()}** [link]({red.link})" if red else f"**{status.upper()}** untraced"


def markdown(rows: list[tuple[Release, dict]], *, date: str, command: str) -> str:
    """The report: a table per peer (checks down, releases across), then every red."""
    out = [f"# Peers across their releases ({date})", "",
           f"`{command}`: every stage check on every release that imports on the CPU "
           "environment (rlaudit/targets/peers/matrix.py). States: pass, **FAIL** (linked to "
           "the upstream bug or fix), differs (a declared deliberate difference), unsupported "
           "(the release lacks what the check needs), n/a (the adapter has no such stage).", ""]
    for peer in dict.fromkeys(r.peer for r, _ in rows):
        mine = [(r, f) for r, f in rows if r.peer == peer]
        checks = list(dict.fromkeys(c for _, f in mine for c in f.get("checks", {})))
        out += [f"## {peer}", "", "| check | " + " | ".join(r.version for r, _ in mine) + " |",
                "|---|" + "---|" * len(mine)]
        if any("error" in f for _, f in mine):
            out.append("| (release) | " + " | ".join(f.get("error", "ok").replace("|", "/")
                                                     for _, f in mine) + " |")
        shown = [c for c in checks if not all(
            f.get("checks", {}).get(c, {}).get("status") == "n/a" for _, f in mine)]
        if checks and not shown:
            out.append("| (every check) | " + " | ".join("n/a" for _ in mine) + " |")
        for check in shown:     # a stage no release of this peer's adapter provides is left out
            out.append(f"| `{check}` | " + " | ".join(cell(peer, r.version, check, f)
                                                     for r, f in mine) + " |")
        out.append("")
    out += ["## Every red", ""]
    for r, f in rows:
        for check, c in f.get("checks", {}).items():
            if c["status"] in REDS:
                red = traced(r.peer, r.version, check)
                why = f"{red.what} ({red.link})" if red else f"untraced: {c['message'][:200]}"
                out.append(f"- {r.spec} `{check}`: {why}")
    return "\n".join(out) + "\n"


def run(only: list[str] | None, jobs: int, report_dir: Path) -> int:
    todo = releases(only)
    workdir = report_dir / "peers-matrix"
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        found = list(pool.map(lambda r: audit(r, workdir), todo))
    for r, f in zip(todo, found):
        state = f.get("error") or f"{sum(c['status'] in REDS for c in f['checks'].values())} red"
        print(f"{r.spec}: {state}", file=sys.stderr)
    command = "make peers-matrix" + (f" ONLY={','.join(only)}" if only else "")
    date = time.strftime("%Y-%m-%d")
    (report_dir / "peers-matrix.json").write_text(json.dumps(
        {"date": date, "seconds": round(time.perf_counter() - t0), "releases": found},
        indent=1) + "\n")
    (report_dir / "peers-matrix.md").write_text(
        markdown(list(zip(todo, found)), date=date, command=command))
    print(f"{len(todo)} releases in {time.perf_counter() - t0:.0f} s: "
          f"{report_dir / 'peers-matrix.md'}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlaudit.targets.peers.matrix",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", choices=sorted(PEERS), help="this peer only")
    p.add_argument("--jobs", type=int, default=2, help="audits at a time (default %(default)s)")
    p.add_argument("--report-dir", type=Path, default=Path("reports"))
    p.add_argument("--one", metavar="PEER==VERSION", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        args.out.write_text(json.dumps(audit_one(args.one)))
        return 0
    return run(args.only, max(1, args.jobs), args.report_dir)


if __name__ == "__main__":
    sys.exit(main())
