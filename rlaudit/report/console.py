"""Plain-text rendering of scenario results: the table ``rlaudit run`` prints."""

from __future__ import annotations

from rlaudit.report.localise_view import console_lines
from rlaudit.verdict.result import (NOTHING_APPLIED, PASSED, STATES, STATUS_ORDER, UNSUPPORTED,
                                    ScenarioResult)

SYMBOL = {"pass": "pass", "fail": "FAIL", "n/a": "n/a", "error": "ERROR", "differs": "differs",
          UNSUPPORTED: "unsupported"}
GOLDEN_SYMBOL = {"pass": "pass", "fail": "FAIL", "stale": "STALE", "no golden": "no golden",
                 "blessed": "BLESSED", "refused": "REFUSED"}


def _cell(statuses: list[str]) -> str:
    for s in STATUS_ORDER:
        if s in statuses:
            return SYMBOL[s]
    return "-"


def render_result(res: ScenarioResult) -> str:
    """One scenario: a row per invariant, a column per backend, worst drift, then failures."""
    backends = res.backends
    rows = []
    invs = list(dict.fromkeys(c.invariant for c in res.checks))
    for inv in invs:
        cells, drift = [], None
        for b in backends:
            cs = [c for c in res.checks if c.invariant == inv and c.backend in (b, "*")]
            cells.append(_cell([c.status for c in cs]))
            for c in cs:
                if c.drift is not None:
                    drift = max(drift or 0.0, c.drift)
        rows.append([inv, *cells, "" if drift is None else f"{drift:.1e}"])
    if res.golden:
        cells = []
        for b in backends:
            g = [x for x in res.golden if x.backend == b]
            cells.append(GOLDEN_SYMBOL.get(g[0].status, g[0].status) if g else "-")
        worst = max((g.worst_drift or 0.0 for g in res.golden), default=0.0)
        rows.append(["golden", *cells, f"{worst:.1e}" if worst else ""])
    header = ["invariant", *backends, "worst drift"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    verdict = res.state.upper()
    out = [f"{res.scenario}: {verdict} ({res.seconds:.1f}s)", line(header),
           line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    problems = [c for c in res.checks if c.status in ("fail", "error")]
    printed: set = set()  # localisation entries already shown under a check
    for c in problems:
        out.append(f"  {SYMBOL[c.status]} {c.invariant} [{c.backend}]: {c.message}")
        out += console_lines(res, c.invariant, c.backend, printed)
    for g in res.golden:
        if g.status in ("fail", "stale", "blessed", "refused", "no golden"):
            out.append(f"  golden {GOLDEN_SYMBOL[g.status]} [{g.backend}]: {g.message}")
            out += console_lines(res, "golden", g.backend, printed)
    for c in res.checks:
        if c.status == "differs":
            out.append(f"  differs {c.invariant} [{c.backend}] (declared): {c.message}")
    for c in res.unsupported:
        out.append(f"  unsupported {c.invariant} [{c.backend}] (not a failure): {c.message}")
    for b in backends:
        mine = [c for c in res.checks if c.backend == b]
        golden = [g for g in res.golden if g.backend == b and g.status != "no golden"]
        if mine and all(c.status in ("n/a", UNSUPPORTED) for c in mine) and not golden \
                and b not in res.errors:
            why = list(dict.fromkeys(c.message for c in mine))
            more = f" (+{len(why) - 2} more reasons)" if len(why) > 2 else ""
            out.append(f"  n/a [{b}]: no check applied to this backend: "
                       f"{'; '.join(why[:2])}{more}")
    for b, err in res.errors.items():
        if len(err.splitlines()) < 2:
            continue        # the whole of it is the ERROR line above
        out.append(f"  backend {b} crashed:\n" + "\n".join("    " + ln for ln in err.splitlines()[-15:]))
    return "\n".join(out)


def render_summary(results: list[ScenarioResult]) -> str:
    """"3/5 scenarios passed (1 no golden, 1 failed)", then the checks the release under audit
    could not run (counted apart: neither failed nor passed), then one line per scenario not
    passed."""
    passed = sum(r.passed for r in results)
    others = [s for s in STATES if s != PASSED and any(r.state == s for r in results)]
    counts = ", ".join(f"{sum(r.state == s for r in results)} {s}" for s in others)
    lines = [f"{passed}/{len(results)} scenarios passed" + (f" ({counts})" if counts else "")]
    lacking = [c for r in results for c in r.unsupported]
    if lacking:
        names = list(dict.fromkeys(c.invariant for c in lacking))
        more = f" (+{len(names) - 6} more)" if len(names) > 6 else ""
        lines.append(f"{len(lacking)} check(s) unsupported by the release under audit (not "
                     f"failures, nothing verified): {', '.join(names[:6])}{more}")
    if results and all(r.state == NOTHING_APPLIED for r in results):
        what = "n/a or unsupported by the release" if lacking else "n/a"
        lines.append(f"nothing was checked: every check of every scenario was {what} (the "
                     "target supports none of what they exercise); exit 1")
    for r in results:
        if not r.passed:
            lines.append(f"  {r.state.upper()} {r.scenario}")
    return "\n".join(lines)
