"""``rlaudit report``: metric drift across invocations logged to MLflow by ``rlaudit run``.

    rlaudit report                                  # last 10 invocations, terminal table
    rlaudit report --last 3 --format html --out drift.html
    rlaudit report --since 2026-11-01 --until 2026-11-07 --format md --out "$GITHUB_STEP_SUMMARY"
    rlaudit report --runs <run-id-or-name A> <run-id-or-name B>

Exit codes: 0 nothing drifts, 1 some metric is out of bounds / drifting / missing, 2 bad input
(bad option, no store, MLflow unreachable, nothing selected). What "drifting" means is in
rlaudit/report/drift.py.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from pathlib import Path

from rlaudit import switches
from rlaudit.cli.argcheck import check_dir_option, check_file_option, check_sqlite_store
from rlaudit.cli.common import DEFAULT_REPORTS
from rlaudit.errors import EXIT_CHECK_FAILED, EXIT_OK, InputError
from rlaudit.report.redact import redact

#: invocations compared when no selection is given
DEFAULT_LAST = 10
#: where --format html goes without --out (under --report-dir)
DEFAULT_HTML = "drift.html"


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="metric drift across logged runs (table, Markdown, HTML)")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--last", type=int, metavar="N",
                     help=f"the last N invocations (default: {DEFAULT_LAST})")
    sel.add_argument("--since", metavar="DATE", help="invocations started on/after DATE "
                     "(YYYY-MM-DD or ISO date-time, local time unless it has an offset)")
    sel.add_argument("--runs", nargs=2, metavar=("A", "B"),
                     help="compare invocation B against invocation A (run ids or run names)")
    p.add_argument("--until", metavar="DATE", help="with --since: started before the end of DATE")
    p.add_argument("--format", choices=("table", "md", "html"), default="table",
                   help="output format (default: %(default)s)")
    p.add_argument("--out", metavar="PATH", help="write the report here (default: stdout; for "
                   f"html: <report-dir>/{DEFAULT_HTML})")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: "
                   "$MLFLOW_TRACKING_URI, else the sqlite store under --report-dir)")
    p.add_argument("--report-dir", default=switches.reports_dir(DEFAULT_REPORTS),
                   help="where `rlaudit run` put its embedded MLflow store (default: %(default)s)")
    p.add_argument("--experiment", default="rlaudit",
                   help="MLflow experiment (default: %(default)s)")
    p.set_defaults(func=run)


def parse_date(text: str, *, end: bool, key: str) -> _dt.datetime:
    """ISO date or date-time -> aware datetime. A bare date with ``end`` means the end of that
    day (the next midnight, exclusive), so ``--until 2026-11-07`` includes the 7th."""
    try:
        if len(text) == 10:
            day = _dt.date.fromisoformat(text)
            when = _dt.datetime.combine(day + _dt.timedelta(days=1 if end else 0), _dt.time())
        else:
            when = _dt.datetime.fromisoformat(text)
    except ValueError:
        raise InputError(f"not a date: {text!r} (expected YYYY-MM-DD or an ISO date-time)",
                         key=key) from None
    return when if when.tzinfo else when.astimezone()


def selection(args):
    # lazy: report and MLflow modules: kept out of CLI start-up
    from rlaudit.report.drift import Selection
    if args.until and not args.since:
        raise InputError("--until needs --since", key="--until")
    if args.since:
        since = parse_date(args.since, end=False, key="--since")
        until = parse_date(args.until, end=True, key="--until") if args.until else None
        if until is not None and until <= since:
            raise InputError(f"--until {args.until} is not after --since {args.since}",
                             key="--until")
        return Selection(since=since, until=until)
    if args.runs:
        if args.runs[0] == args.runs[1]:
            raise InputError("--runs needs two different runs", key="--runs")
        return Selection(runs=tuple(args.runs))
    last = DEFAULT_LAST if args.last is None else args.last
    if last < 1:
        raise InputError(f"--last must be at least 1, got {last}", key="--last")
    return Selection(last=last)


def open_store(tracking_uri: str | None, report_dir: Path):
    """An MlflowClient for reading; InputError when there is no store or it cannot be reached."""
    # lazy: report and MLflow modules: kept out of CLI start-up
    from rlaudit.report.mlflow_log import EMBEDDED_DB, preflight, resolve_tracking_uri
    from rlaudit.report.mlflow_guard import ping  # lazy: as above
    uri, _ = resolve_tracking_uri(tracking_uri, report_dir)
    if not tracking_uri and not os.environ.get("MLFLOW_TRACKING_URI"):
        if not (report_dir / EMBEDDED_DB).exists():
            raise InputError(f"no MLflow store at {report_dir / EMBEDDED_DB}: run `rlaudit run` "
                             f"first, or pass --tracking-uri", key="--report-dir")
        check_sqlite_store(report_dir / EMBEDDED_DB, "--report-dir")
    try:
        preflight(uri)
        ping(uri)  # it answers a request, whole, within seconds: not merely accepts
    except OSError as e:
        raise InputError(redact(f"cannot reach MLflow at {uri}: {e}", uri),
                         key="--tracking-uri") from None
    try:
        # lazy: mlflow: 1-2 s import, only `report` needs it
        from mlflow.tracking import MlflowClient
    except ImportError as e:
        raise InputError(f"MLflow is not installed ({e}); pip install 'rlaudit[mlflow]'") from None
    try:
        return MlflowClient(tracking_uri=uri), uri
    except Exception as e:  # noqa: BLE001 - a store MLflow cannot open: a corrupt sqlite file, ...
        flag = "--tracking-uri" if tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") \
            else "--report-dir"
        first = str(e).splitlines()[0] if str(e) else ""
        raise InputError(f"cannot open the MLflow store at {uri} (corrupt or not an MLflow "
                         f"store?): {type(e).__name__}: {first}", key=flag) from None


def run(args) -> int:
    from rlaudit.report import drift  # lazy: report and MLflow modules: kept out of CLI start-up
    from rlaudit.report.mlflow_log import bounded_http  # lazy: as above
    from rlaudit.report.render import write_atomic  # lazy: as above
    sel = selection(args)
    report_dir = Path(args.report_dir)
    check_dir_option(report_dir, "--report-dir")
    if args.out:  # an --out that is a directory fails now, not after reading every run
        check_file_option(args.out, "--out")
    with bounded_http():
        client, uri = open_store(args.tracking_uri, report_dir)
        try:
            window = drift.fetch_window(client, args.experiment, sel)
        except InputError:
            raise
        except Exception as e:  # MLflow errors: wrong URI, a server answering errors, ...
            raise InputError(redact(f"could not read runs from MLflow at {uri}: "
                                    f"{type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}", uri),
                             key="--tracking-uri") from None
    table = drift.analyse(window)
    text = drift.render_text(table, window)
    out = Path(args.out) if args.out else (report_dir / DEFAULT_HTML if args.format == "html"
                                           else None)
    if args.format == "table":
        body = text + "\n"
    elif args.format == "md":
        body = drift.render_markdown(table, window)
    else:
        body = drift.render_html(table, window)
    if out is None:
        sys.stdout.write(body)
    else:
        write_atomic(out, body)
        print(text)
        print(f"drift report: {out}", file=sys.stderr)
    return EXIT_CHECK_FAILED if len(drift.flagged(table)) else EXIT_OK
