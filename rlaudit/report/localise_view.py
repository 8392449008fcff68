"""Rendering the drift localisation (``ScenarioResult.localisation``, see
rlaudit/scenarios/localise.py): lines under a failing check in the console table, a section with the drift-vs-depth plot in the
HTML and Markdown reports, and the JSON/PNG artifacts MLflow logs.

Every function returns nothing (an empty list, None, "") for a result without localisation, so a
passing scenario renders exactly as before.
"""

from __future__ import annotations

import json
import re

from rlaudit.report import render as R

#: module names in the compact curve line and the plot's x axis
_SHORT = ((r"^model\.embed_tokens$", "embed"), (r"^model\.layers\.(\d+)$", r"L\1"),
          (r"^model\.layers\.(\d+)\.input_layernorm$", r"L\1.in_norm"),
          (r"^model\.layers\.(\d+)\.self_attn$", r"L\1.attn"),
          (r"^model\.layers\.(\d+)\.post_attention_layernorm$", r"L\1.mlp_norm"),
          (r"^model\.layers\.(\d+)\.mlp$", r"L\1.mlp"), (r"^model\.norm$", "norm"),
          (r"^lm_head$", "lm_head"))
#: divergent quantities listed per entry
SHOWN_DIVERGENCES = 3


def short_module(name: str) -> str:
    for pattern, repl in _SHORT:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    return name


def _num(x) -> str:
    return R.fmt_num(x, 2) if x is not None else "-"


def _ranges_text(ranges) -> str:
    """", rows 128-255 of 256" for the dimensions not wholly out of tolerance."""
    if not ranges:
        return ""
    dims = (("rows", "columns") if len(ranges) == 2
            else tuple(f"dim {d}" for d in range(len(ranges))))
    parts = [f"{dims[d]} {lo}-{hi} of {n}" for d, (lo, hi, n) in enumerate(ranges)
             if (lo, hi) != (0, n - 1)]
    return (", " + ", ".join(parts)) if parts else ", everywhere"


def _param_drift(c: dict) -> float | None:
    """The largest drift of a module's parameter gradients (backward curves), or None."""
    params = c.get("params") or []
    return max(p["drift"] for p in params) if params else None


def _layer_lines(layers: dict) -> list[str]:
    if layers.get("error"):
        return [f"model probe: {layers['error']}"]
    out = []
    direction = layers["direction"]
    if layers.get("module"):
        out.append(f"first module out of tolerance ({direction}): {layers['module']} — "
                   f"{layers.get('what', 'output')}: drift {_num(layers.get('drift'))} "
                   f"(bound {_num(layers.get('bound'))}, max|diff| / rms)")
    else:
        worst = max((c.get("drift") or 0.0 for c in layers.get("curve", [])), default=0.0)
        out.append(f"every module's {'output' if direction == 'forward' else 'gradient'} agrees "
                   f"({direction}; largest drift {_num(worst)})")
    if direction == "backward":
        out.append("forward: " + (f"first module out of tolerance {layers['forward_module']}"
                                  if layers.get("forward_module") else "every module agrees"))
    if layers.get("note"):
        out.append(layers["note"])
    curve = layers.get("curve", [])
    if curve:
        out.append(f"drift over depth ({direction}"
                   + ("; gradient at the output [its parameters' gradients]"
                      if direction == "backward" else "") + "): " + " · ".join(
            f"{short_module(c['module'])} {_num(c.get('drift'))}"
            + (f" [{_num(_param_drift(c))}]" if _param_drift(c) is not None else "")
            for c in curve))
    if direction == "backward":
        first = next((c for c in curve if c["module"] == layers.get("module")), None)
        for p in (first or {}).get("params", []):
            if p["out"]:
                out.append(f"  {p['parameter']}: {p['entries_out']} of {p['numel']} gradient "
                           f"entries out{_ranges_text(p.get('ranges_out'))}; "
                           f"drift {_num(p['drift'])}")
    tokens = layers.get("worst_tokens") or []
    if tokens:
        out.append("worst tokens there: " + "; ".join(
            f"row {t['row']} pos {t['position']} ({t['part']}, id {t['token_id']}) "
            f"{_num(t['max_abs_diff'])}" for t in tokens))
    return out


def entry_lines(entry: dict) -> list[str]:
    """The plain-text lines of one localisation entry (first line: the summary)."""
    if entry.get("error"):
        return [f"where: localisation failed ({entry['error']})"]
    against = entry.get("against", "reference")
    head = f"where: {entry.get('summary', '')}"
    if entry.get("variant"):
        head += f" [variant {entry['variant']} vs {against}]"
    out = [head]
    if entry.get("agreed"):
        out.append(f"agree before it: {', '.join(entry['agreed'])}")
    for d in (entry.get("divergences") or [])[:SHOWN_DIVERGENCES]:
        if d.get("message"):
            out.append(f"  {d['message']}")
    more = len(entry.get("divergences") or []) - SHOWN_DIVERGENCES
    if more > 0:
        out.append(f"  (+{more} more)")
    if entry.get("update"):
        u = entry["update"]
        out.append(f"parameter update got/want: median {u['median']:.6g} (p10 {u['p10']:.6g}, "
                   f"p90 {u['p90']:.6g}, {u['entries']} entries)")
    if entry.get("by_response_position"):
        out.append("max |diff| by response position: " + " ".join(
            _num(x) for x in entry["by_response_position"]))
    if entry.get("layers"):
        out += _layer_lines(entry["layers"])
    probe = entry.get("probe")
    if probe:
        if probe.get("error"):
            out.append(f"probe re-run failed: {probe['error']}")
        else:
            out.append(f"probe re-run: {probe.get('seconds', 0):.1f}s (step "
                       f"{probe['target_step']}, rows {probe['rows']}, {probe['role']})")
    if entry.get("note") and not entry.get("layers", {}).get("note") == entry["note"]:
        out.append(entry["note"])
    return out


def console_lines(res, invariant: str, backend: str, printed: set, indent: str = "    "
                  ) -> list[str]:
    """Lines to print under the failing check (``invariant``, ``backend``); an entry already
    printed under another check is referred to, not repeated (``printed`` tracks them)."""
    out = []
    for i, entry in enumerate(getattr(res, "localisation", None) or []):
        if entry.get("backend") != backend or invariant not in entry.get("checks", []):
            continue
        if i in printed:
            out.append(f"{indent}where: see {entry['checks'][0]} [{backend}] above")
            continue
        printed.add(i)
        out += [indent + line for line in entry_lines(entry)]
    return out


# ---- plot and report sections ------------------------------------------------------------------

def drift_plot(res) -> bytes | None:
    """Drift vs depth, one line per localised backend (log scale), with its tolerance bound
    dashed and the first module out of tolerance marked; None without a layer probe."""
    entries = [e for e in getattr(res, "localisation", None) or []
               if (e.get("layers") or {}).get("curve")]
    if not entries:
        return None
    plt = R.pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6), layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels: list[str] = []
    for i, e in enumerate(entries):
        layers = e["layers"]
        curve = [c for c in layers["curve"] if c.get("drift") is not None]
        names = [short_module(c["module"]) for c in curve]
        if len(names) > len(labels):
            labels = names
        floor = 1e-18  # exact agreement drawn at the floor of the log scale
        ys = [max(c["drift"], floor) for c in curve]
        colour = colours[i % len(colours)]
        what = "gradient at each output" if layers["direction"] == "backward" else "outputs"
        ax.plot(range(len(ys)), ys, marker="o", ms=4, color=colour,
                label=f"{e['backend']} vs {e.get('against', 'reference')}: {what}")
        ax.plot(range(len(ys)), [max(c.get("bound") or floor, floor) for c in curve],
                ls="--", lw=1, color=colour, alpha=0.6)
        if layers["direction"] == "backward":  # parameters' gradients, where a module has any
            pts = [(k, _param_drift(c)) for k, c in enumerate(curve)
                   if _param_drift(c) is not None]
            ax.plot([k for k, _ in pts], [max(d, floor) for _, d in pts], ls=":", marker="s",
                    ms=4, mfc="none", color=colour,
                    label=f"{e['backend']}: its parameters' gradients")
        if layers.get("module"):
            j = next((k for k, c in enumerate(curve) if c["module"] == layers["module"]), None)
            if j is not None:
                y = (_param_drift(curve[j]) if str(layers.get("what", "")).startswith("parameter")
                     else ys[j])
                ax.plot([j], [max(y or floor, floor)], marker="x", ms=11, mew=2, color="#cf222e")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("max |diff| / rms (0 drawn at 1e-18)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False)
    ax.set_title(f"{res.scenario}: drift vs depth (dashed: tolerance; x: first module out)",
                 fontsize=9)
    return R.fig_png(fig)


def html_section(res, png: bytes | None) -> str:
    entries = getattr(res, "localisation", None) or []
    if not entries:
        return ""
    out = ["<h3>Where it diverged</h3>"]
    for e in entries:
        lines = entry_lines(e)
        out.append(f"<p><b>{R.esc(e.get('backend', '?'))}</b> "
                   f"<span class=\"muted\">({R.esc(', '.join(e.get('checks', [])))})</span></p>"
                   f"<pre>{R.esc(chr(10).join(lines))}</pre>")
    if png:
        out.append(R.img(png, f"{res.scenario} drift vs depth"))
    return "\n".join(out)


def markdown_lines(res, plot_path: str | None) -> list[str]:
    entries = getattr(res, "localisation", None) or []
    if not entries:
        return []
    out = ["", "### Where it diverged", ""]
    for e in entries:
        out += [f"**{e.get('backend', '?')}** ({', '.join(e.get('checks', []))})", "", "```",
                *entry_lines(e), "```", ""]
    if plot_path:
        out.append(f"![{res.scenario} drift vs depth]({plot_path})")
    return out


def artifact_json(res, backend: str) -> str | None:
    """``localisation.json`` for a backend's MLflow child run (None when it has no entry)."""
    mine = [e for e in getattr(res, "localisation", None) or [] if e.get("backend") == backend]
    if not mine:
        return None
    return json.dumps(mine, indent=1, default=str)
