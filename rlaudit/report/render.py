"""Building blocks shared by the run report and the drift report: a self-contained HTML page
(inline CSS, plots embedded as base64 PNG or SVG), coloured status cells, Markdown and plain-text
tables, matplotlib figures rendered off-screen, and atomic file writes.

Nothing here knows about scenarios or MLflow; callers pass rows of already-formatted cells.

    page("title", [h(2, "Summary"), table(["a", "b"], [["1", status_cell("pass")]])])
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

#: status word -> CSS class; words not listed render as plain text
STATUS_CLASS = {
    "pass": "ok", "ok": "ok", "blessed": "warn", "n/a": "na", "none": "na", "missing": "bad",
    "fail": "bad", "FAIL": "bad", "error": "err", "ERROR": "err", "stale": "warn",
    "no golden": "warn", "refused": "bad", "passed": "ok", "failed": "bad", "bad input": "err",
    "interrupted": "err",
    "drift": "warn", "differs": "warn", "out-of-bounds": "bad", "new": "na", "unsupported": "na",
}
#: resolution of embedded plots: sharp on a laptop screen, small enough to keep pages < ~1 MB
PLOT_DPI = 100

CSS = """
body{font-family:-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
 margin:0;background:#f4f6f8;color:#1f2328;font-size:14px}
header{background:#1f2937;color:#fff;padding:18px 32px}
header h1{margin:0;font-size:22px;font-weight:600}
header .sub{color:#cbd5e1;margin-top:4px;font-size:13px}
main{padding:20px 32px;max-width:1400px}
section.card{background:#fff;border:1px solid #d8dee4;border-radius:8px;padding:16px 20px;
 margin-bottom:20px;box-shadow:0 1px 2px rgba(0,0,0,.04)}
h2{font-size:18px;margin:0 0 10px 0}
h3{font-size:15px;margin:16px 0 8px 0;color:#374151}
table{border-collapse:collapse;margin:6px 0 10px 0;font-size:13px}
th,td{border:1px solid #d8dee4;padding:4px 10px;text-align:left;vertical-align:top}
th{background:#f0f3f6;font-weight:600}
td.num{text-align:right;font-family:ui-monospace,SFMono-Regular,Menlo,monospace}
td.ok{background:#dafbe1;color:#116329;font-weight:600}
td.bad{background:#ffebe9;color:#a40e26;font-weight:700}
td.err{background:#fff1e5;color:#953800;font-weight:700}
td.warn{background:#fff8c5;color:#7d4e00;font-weight:600}
td.na{color:#6e7781}
tr.flag td{background:#fff5f5}
.badge{display:inline-block;padding:2px 10px;border-radius:12px;font-weight:700;font-size:12px;
 margin-left:8px;vertical-align:middle}
.badge.ok{background:#1a7f37;color:#fff}.badge.bad{background:#cf222e;color:#fff}
.badge.warn{background:#bf8700;color:#fff}.badge.na{background:#6e7781;color:#fff}
.stats{display:flex;gap:14px;flex-wrap:wrap;margin:4px 0}
.stat{background:#f6f8fa;border:1px solid #d8dee4;border-radius:6px;padding:8px 14px;
 min-width:110px}
.stat b{display:block;font-size:20px}.stat span{color:#57606a;font-size:12px}
ul.fail li{margin:3px 0}ul.fail code{background:#ffebe9}
pre{background:#f6f8fa;border:1px solid #d8dee4;padding:8px;overflow-x:auto;font-size:12px}
img.plot{max-width:100%;border:1px solid #d8dee4;border-radius:4px;background:#fff}
.muted{color:#6e7781}
details summary{cursor:pointer;color:#0969da;margin:6px 0}
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def fmt_num(x: object, digits: int = 6) -> str:
    """Numbers compactly (``1.234e-07``, ``0.01234``); ``""`` for None; others via str()."""
    if x is None:
        return ""
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, (int, float)):
        xf = float(x)
        if math.isnan(xf):
            return "nan"
        if math.isinf(xf):
            return "inf" if xf > 0 else "-inf"
        return f"{xf:.{digits}g}"
    return str(x)


class Cell:
    """A table cell with an optional CSS class (``ok``, ``bad``, ``num``...)."""

    def __init__(self, text: object, cls: str = ""):
        self.text, self.cls = str(text), cls

    def __str__(self) -> str:
        return self.text


def status_cell(status: str) -> Cell:
    return Cell(status, STATUS_CLASS.get(status, ""))


def num_cell(x: object, digits: int = 6) -> Cell:
    return Cell(fmt_num(x, digits), "num")


def table(header: Sequence[str], rows: Iterable[Sequence[object]], *,
          flag_rows: Sequence[bool] | None = None) -> str:
    """An HTML table; cells may be :class:`Cell` (for colour) or anything str()-able."""
    out = ["<table><thead><tr>", *(f"<th>{esc(c)}</th>" for c in header), "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        flagged = flag_rows is not None and flag_rows[i]
        out.append('<tr class="flag">' if flagged else "<tr>")
        for c in row:
            cls = c.cls if isinstance(c, Cell) else ""
            out.append(f'<td class="{cls}">{esc(c)}</td>' if cls else f"<td>{esc(c)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def badge(text: str, cls: str) -> str:
    return f'<span class="badge {cls}">{esc(text)}</span>'


def stats(items: Sequence[tuple[str, object]]) -> str:
    cards = "".join(f'<div class="stat"><b>{esc(v)}</b><span>{esc(k)}</span></div>'
                    for k, v in items)
    return f'<div class="stats">{cards}</div>'


def img(image: bytes, alt: str) -> str:
    """``image`` (PNG or SVG bytes) embedded in the page as a data URI."""
    mime = "image/svg+xml" if image.lstrip()[:4] in (b"<svg", b"<?xm") else "image/png"
    data = base64.b64encode(image).decode("ascii")
    return f'<img class="plot" alt="{esc(alt)}" src="data:{mime};base64,{data}">'


def page(title: str, subtitle: str, body: Sequence[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>{esc(title)}</h1><div class=\"sub\">{esc(subtitle)}</div></header>"
            "<main>" + "\n".join(body) + "</main></body></html>\n")


# ---- Markdown and plain text ---------------------------------------------------------------------

def md_escape(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(md_escape(h) for h in header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    rule = ["-" * w for w in widths]
    return "\n".join([line(cells[0]), line(rule)] + [line(r) for r in cells[1:]])


# ---- figures and files ---------------------------------------------------------------------------

def pyplot():
    """matplotlib.pyplot on the off-screen Agg backend (no display on CI machines)."""
    import matplotlib  # lazy: slow to import; only a report with plots needs it
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # lazy: see matplotlib above
    return plt


def fig_png(fig) -> bytes:
    """Render and close ``fig`` (closing keeps long report runs from accumulating figures).

    Every figure here is laid out by matplotlib's constrained layout, which keeps titles, labels
    and an ``outside`` legend inside the canvas; ``bbox_inches="tight"`` would draw and encode
    the figure a second time to measure it, for no change."""
    plt = pyplot()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=PLOT_DPI)
    finally:
        plt.close(fig)
    return buf.getvalue()


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write via a temp file in the same directory + os.replace: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report is a normal file
        os.replace(tmp, path)
    except OSError as e:  # a full disk's write names no file: this one is named
        Path(tmp).unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def safe_filename(name: str) -> str:
    """A scenario or metric name usable as a file name (``actor/pg_loss`` -> ``actor_pg_loss``)."""
    out = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".")
    return out or "unnamed"
