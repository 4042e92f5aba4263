"""``nexrl report RUN_DIR [-o FILE]``: one self-contained HTML page of a run.

The page holds the metric plots of ``metrics.jsonl`` (inline SVG drawn here, no plotting
library) and the samples of ``samples.jsonl`` in a table that a few lines of inline JavaScript
filter by text, step and reward. It refers to nothing outside itself (no script, style sheet,
font or image to fetch; its Content-Security-Policy forbids fetching anything), so it opens
offline and can be mailed. Every text from the run is HTML-escaped and scrubbed of known
secrets. Plain Python: no matplotlib needed.
"""

from __future__ import annotations

import html
import json
import math
import os
import time
from typing import Any

from ..errors import ConfigError
from ..redaction import scrub, scrub_values
from ..runtime.run_log import METRICS_FILE, SAMPLES_FILE, read_jsonl, writable_dir_problem
from .plot import (
    _SMOOTH,
    GRAD_NORM,
    TRAIN_REWARD,
    _running_mean,
    _title,
    domain_reward_keys,
    series,
    update_key,
    validation_keys,
)
from .show import GAP_KEY, _is_number, _number, _prompt_text, gap_where, large_gap, sample_gap

REPORT_FILE = "report.html"
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf")
_MAX_POINTS = 600  # a line with more points is thinned (every k-th point, the last kept)
_HUGE = 1e300  # metrics.jsonl writes +-inf as +-1e308: left out of a plot's scale


# -- reading -----------------------------------------------------------------------------------------

def _rows(run_dir: str, name: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, name)
    return scrub_values(read_jsonl(path)) if os.path.isfile(path) else []


def _run_info(run_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


# -- SVG plots ---------------------------------------------------------------------------------------

def _nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten."""
    span = hi - lo
    raw = span / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    if integer:
        step = max(1.0, float(round(step)))
    first = math.floor(lo / step + 1e-9) * step
    # by index, not by adding: a step below the values' float resolution must still end
    count = min(int(math.ceil((hi - first) / step - 1e-9)) + 1, 4 * count + 2)
    return [round(first + i * step, 12) for i in range(max(count, 2))]


def _tick_text(value: float) -> str:
    return f"{value:.4g}" if value != 0 else "0"


def _thin(points: list[tuple[int, float]], limit: int) -> list[tuple[int, float]]:
    if len(points) <= limit:
        return points
    stride = math.ceil(len(points) / limit)
    kept = points[::stride]
    return kept if kept[-1] == points[-1] else kept + [points[-1]]


def svg_chart(lines: list[dict[str, Any]], y_label: str, width: int = 760, height: int = 240,
              max_points: int = _MAX_POINTS) -> str:
    """An SVG line chart of ``lines`` (each: ``label``, ``points`` [(step, value)], ``color``,
    optional ``width``, ``dash``, ``opacity``, ``markers``) against the training step."""
    lines = [dict(line, points=_thin([(x, y) for x, y in line["points"] if abs(y) < _HUGE], max_points))
             for line in lines]
    drawn = [p for line in lines for p in line["points"]]
    left, right, top, bottom = 62, 14, 10, 34
    out = [f'<svg class="chart" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(y_label)}">']
    if not drawn:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no finite values</text></svg>')
        return "".join(out)
    xs, ys = [p[0] for p in drawn], [p[1] for p in drawn]
    x_lo, x_hi = min(xs), max(xs)
    if x_lo == x_hi:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi = min(ys), max(ys)
    if y_lo == y_hi:
        pad = abs(y_lo) * 0.1 or 1.0
        y_lo, y_hi = y_lo - pad, y_hi + pad
    x_ticks = _nice_ticks(x_lo, x_hi, 8, integer=True)
    y_ticks = _nice_ticks(y_lo, y_hi, 5)
    x_lo, x_hi = min(x_lo, x_ticks[0]), max(x_hi, x_ticks[-1])
    y_lo, y_hi = min(y_lo, y_ticks[0]), max(y_hi, y_ticks[-1])
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return round(left + (x - x_lo) / (x_hi - x_lo) * plot_w, 1)

    def py(y: float) -> float:
        return round(top + (y_hi - y) / (y_hi - y_lo) * plot_h, 1)

    for t in y_ticks:
        out.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{py(t)}" y2="{py(t)}"/>'
                   f'<text class="tick" x="{left - 6}" y="{py(t) + 4}" text-anchor="end">{_tick_text(t)}</text>')
    for t in x_ticks:
        out.append(f'<line class="grid" x1="{px(t)}" x2="{px(t)}" y1="{top}" y2="{top + plot_h}"/>'
                   f'<text class="tick" x="{px(t)}" y="{top + plot_h + 16}" text-anchor="middle">{int(t)}</text>')
    out.append(f'<rect class="frame" x="{left}" y="{top}" width="{plot_w}" height="{plot_h}"/>')
    out.append(f'<text class="axis" x="{left + plot_w / 2}" y="{height - 3}" text-anchor="middle">step</text>')
    out.append(f'<text class="axis" transform="translate(13 {top + plot_h / 2}) rotate(-90)" '
               f'text-anchor="middle">{html.escape(y_label)}</text>')
    for line in lines:
        if not line["points"]:
            continue
        color, label = line["color"], html.escape(line["label"])
        dash = f' stroke-dasharray="{line["dash"]}"' if line.get("dash") else ""
        opacity = f' stroke-opacity="{line["opacity"]}"' if line.get("opacity") is not None else ""
        coords = " ".join(f"{px(x)},{py(y)}" for x, y in line["points"])
        out.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="{line.get("width", 2)}"'
                   f'{dash}{opacity} points="{coords}"><title>{label}</title></polyline>')
        if line.get("markers") or len(line["points"]) == 1:
            out.extend(f'<circle cx="{px(x)}" cy="{py(y)}" r="3.5" fill="{color}">'
                       f'<title>{label} @ step {x}: {_tick_text(y)}</title></circle>' for x, y in line["points"])
    out.append("</svg>")
    return "".join(out)


def _legend(lines: list[dict[str, Any]]) -> str:
    keys = []
    for line in lines:
        style = "dashed" if line.get("dash") else "solid"
        keys.append(f'<span class="key"><i style="border-top: 3px {style} {line["color"]}"></i>'
                    f'{html.escape(line["label"])}</span>')
    return f'<div class="legend">{"".join(keys)}</div>'


def _panels(found: dict[str, list[tuple[int, float]]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The main plots (as ``nexrl plot`` draws them): training reward, validation, the update."""
    panels = []
    if TRAIN_REWARD in found:
        points = found[TRAIN_REWARD]
        smooth = list(zip([s for s, _ in points], _running_mean([v for _, v in points], _SMOOTH)))
        lines = [{"label": "reward_mean", "points": points, "color": _PALETTE[0], "width": 1, "opacity": 0.4},
                 {"label": f"running mean ({_SMOOTH} steps)", "points": smooth, "color": _PALETTE[0], "width": 2.5}]
        for i, key in enumerate(domain_reward_keys(found)):
            domain = found[key]
            lines.append({"label": f"{key.split('/')[1]} (running mean)", "dash": "6 4", "width": 1.5,
                          "color": _PALETTE[(i + 1) % len(_PALETTE)],
                          "points": list(zip([s for s, _ in domain], _running_mean([v for _, v in domain], _SMOOTH)))})
        panels.append(("training reward", lines))
    val_keys = validation_keys(found)
    if val_keys:
        panels.append(("validation", [{"label": key, "points": found[key], "color": _PALETTE[i % len(_PALETTE)],
                                       "markers": True} for i, key in enumerate(val_keys)]))
    third = update_key(found)
    if third is not None:
        panels.append(("gradient norm" if third == GRAD_NORM else "loss",
                       [{"label": third, "points": found[third], "color": _PALETTE[3], "width": 1.5}]))
    return panels


def _plots_html(found: dict[str, list[tuple[int, float]]]) -> str:
    if not found:
        return '<p class="none">metrics.jsonl holds no metrics yet.</p>'
    parts = []
    for title, lines in _panels(found):
        parts.append(f'<figure class="panel"><figcaption>{html.escape(title)}</figcaption>'
                     f'{svg_chart(lines, title)}{_legend(lines)}</figure>')
    small = [f'<figure class="small"><figcaption>{html.escape(key)}</figcaption>'
             f'{svg_chart([{"label": key, "points": points, "color": _PALETTE[0], "width": 1.5}], "", 380, 170, 300)}'
             f'</figure>' for key, points in sorted(found.items())]
    parts.append(f'<details><summary>every metric ({len(found)})</summary><div class="grid">{"".join(small)}'
                 f'</div></details>')
    return "".join(parts)


# -- the sample table --------------------------------------------------------------------------------

def _text_cell(text: str, extra: str = "") -> str:
    return f'<td class="text{extra}"><div>{html.escape(text)}</div></td>'


def _sample_row(row: dict[str, Any], gaps: dict[int, float], show_gap: bool, large: float) -> str:
    step = row.get("step") if isinstance(row.get("step"), int) else None
    reward = row.get("reward")
    own = sample_gap(row)
    gap = own["max"] if own is not None else gaps.get(step) if step is not None else None
    attrs = (f' data-step="{"" if step is None else step}" data-reward="{reward if _is_number(reward) else ""}"'
             f' data-gap="{"" if gap is None else gap}"')
    cells = [f'<td class="num">{"-" if step is None else step}</td>',
             f'<td class="id">{html.escape(str(row.get("uid")))}#{html.escape(str(row.get("sample_index", 0)))}'
             + (f'<br><small>{html.escape(str(row["data_source"]))}</small>'
                if row.get("data_source") not in (None, "default") else "")
             + (f'<br><small>weights v{html.escape(str(row["model_version"]))}</small>'
                if row.get("model_version") is not None else "") + "</td>"]
    scores = {k: v for k, v in (row.get("score") or {}).items() if k != "reward"} \
        if isinstance(row.get("score"), dict) else {}
    extra = "".join(f"<br><small>{html.escape(str(k))}={html.escape(_number(v))}</small>"
                    for k, v in sorted(scores.items()))
    cells.append(f'<td class="num">{html.escape(_number(reward))}{extra}</td>')
    advantage = row.get("advantage")
    cells.append(f'<td class="num">{f"{advantage:+.3f}" if _is_number(advantage) else "-"}</td>')
    cells.append(_text_cell(_prompt_text(row.get("prompt"))))
    if row.get("failed"):
        cells.append(_text_cell(f"failed: {row.get('error') or '(no message)'}", " failed"))
    else:
        reply = "" if row.get("response") is None else str(row["response"])
        note = "\n[cut off at max_tokens]" if row.get("finish_reason") == "length" else ""
        cells.append(_text_cell(reply + note))
    if show_gap:
        if gap is None:
            cells.append('<td class="num">-</td>')
        else:
            where = gap_where(own) if own is not None else "the step's"
            notes = [html.escape(where)] if where else []
            if gap > large:
                notes.append("large")
            cells.append(f'<td class="num{" large" if gap > large else ""}">{gap:.3g}'
                         f'{"".join(f"<br><small>{n}</small>" for n in notes)}</td>')
    return f"<tr{attrs}>{''.join(cells)}</tr>"


def _samples_html(samples: list[dict[str, Any]], found: dict[str, list[tuple[int, float]]], large: float) -> str:
    if not samples:
        return (f'<p class="none">no {SAMPLES_FILE} rows: `nexrl run` writes them at the first and the last step '
                f'and every logger.samples_every steps.</p>')
    gaps = dict(found.get(GAP_KEY, []))
    show_gap = bool(gaps) or any(sample_gap(r) is not None for r in samples)
    head = ["step", "sample", "reward", "advantage", "prompt", "reply"]
    if show_gap:
        head.append("log-prob gap")
    gap_note = (f'<p class="note">log-prob gap: the sample\'s largest per-token |trainer &minus; rollout log-prob| '
                f'and the response token where it is (the step\'s largest, {html.escape(GAP_KEY)}, for a sample '
                f'recorded without its own); above {large:.3g} (ln of algorithm.rollout_correction.cap: a token '
                f'{math.exp(large):.3g} times as likely to one as to the other) it is marked large.</p>'
                ) if show_gap else ""
    gap_filter = '\n<label>log-prob gap &ge; <input id="f-gmin" type="number" step="any"></label>' if show_gap else ""
    body = "".join(_sample_row(r, gaps, show_gap, large) for r in samples)
    return f"""<div class="filters">
<label>text <input id="f-text" type="search" placeholder="in prompt or reply"></label>
<label>step <input id="f-step" placeholder="5, 3-8 or 1,4"></label>
<label>reward &ge; <input id="f-rmin" type="number" step="any"></label>
<label>&le; <input id="f-rmax" type="number" step="any"></label>{gap_filter}
<span id="f-count">{len(samples)} of {len(samples)} samples</span>
</div>{gap_note}
<table id="samples"><thead><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr></thead>
<tbody>{body}</tbody></table>"""


# The filter: every field narrows the rows shown; the fields are kept in the address's fragment
# (#text=...&step=...&rmin=...&rmax=...&gmin=...), so a filtered view can be bookmarked or shared.
# gmin (a least log-prob gap) is there only when the table has the gap column.
_SCRIPT = """
(function () {
  var table = document.getElementById("samples");
  if (!table) { return; }
  var rows = Array.prototype.slice.call(table.tBodies[0].rows);
  var texts = rows.map(function (r) { return (r.cells[4].textContent + "\\n" + r.cells[5].textContent).toLowerCase(); });
  var fields = {text: "f-text", step: "f-step", rmin: "f-rmin", rmax: "f-rmax", gmin: "f-gmin"};
  if (!document.getElementById(fields.gmin)) { delete fields.gmin; }
  function field(name) { return document.getElementById(fields[name]); }
  function steps(spec) {
    var parts = spec.split(","), tests = [];
    for (var i = 0; i < parts.length; i++) {
      var m = parts[i].trim().match(/^(\\d+)\\s*(?:-\\s*(\\d+))?$/);
      if (!m) { continue; }
      tests.push([Number(m[1]), Number(m[2] === undefined ? m[1] : m[2])]);
    }
    return tests;
  }
  function bound(name) {
    if (!fields[name]) { return null; }
    var v = field(name).value.trim();
    return v === "" || isNaN(Number(v)) ? null : Number(v);
  }
  function apply() {
    var text = field("text").value.trim().toLowerCase(), spec = field("step").value.trim();
    var ranges = spec ? steps(spec) : null, lo = bound("rmin"), hi = bound("rmax"), gap = bound("gmin"), shown = 0;
    rows.forEach(function (row, i) {
      var ok = !text || texts[i].indexOf(text) >= 0;
      if (ok && ranges) {
        var s = row.dataset.step === "" ? NaN : Number(row.dataset.step);
        ok = ranges.some(function (r) { return s >= r[0] && s <= r[1]; });
      }
      if (ok && (lo !== null || hi !== null)) {
        var v = row.dataset.reward === "" ? NaN : Number(row.dataset.reward);
        ok = !isNaN(v) && (lo === null || v >= lo) && (hi === null || v <= hi);
      }
      if (ok && gap !== null) {
        var g = row.dataset.gap === "" ? NaN : Number(row.dataset.gap);
        ok = !isNaN(g) && g >= gap;
      }
      row.hidden = !ok;
      if (ok) { shown++; }
    });
    document.getElementById("f-count").textContent = shown + " of " + rows.length + " samples";
    var state = new URLSearchParams();
    Object.keys(fields).forEach(function (name) { if (field(name).value) { state.set(name, field(name).value); } });
    try { history.replaceState(null, "", "#" + state.toString()); } catch (e) { /* file: in some browsers */ }
  }
  var given = new URLSearchParams(location.hash.slice(1));
  Object.keys(fields).forEach(function (name) {
    if (given.has(name)) { field(name).value = given.get(name); }
    field(name).addEventListener("input", apply);
  });
  apply();
})();
"""

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .2em; } h2 { font-size: 1.15em; margin: 1.6em 0 .5em; }
.meta { color: #555; margin: 0; } .none, .note { color: #555; }
figure { margin: 0 0 1.2em; } figcaption { font-weight: 600; margin-bottom: .2em; }
.chart text { font-size: 11px; fill: #444; } .chart .axis { font-size: 12px; }
.chart .grid { stroke: #e6e6e6; } .chart .frame { fill: none; stroke: #999; }
.legend { font-size: 12px; } .key { margin-right: 1.2em; white-space: nowrap; }
.key i { display: inline-block; width: 22px; vertical-align: middle; margin-right: .4em; }
.grid { display: flex; flex-wrap: wrap; gap: .5em 1.5em; } .small figcaption { font-weight: 400; font-size: 12px; }
.filters { display: flex; flex-wrap: wrap; gap: .6em 1.2em; align-items: center; margin-bottom: .6em; }
.filters input { font: inherit; width: 9em; } #f-text { width: 18em; } #f-count { color: #555; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ddd; padding: .3em .5em; vertical-align: top; text-align: left; }
th { background: #f4f4f4; position: sticky; top: 0; }
td.num, td.id { white-space: nowrap; font-variant-numeric: tabular-nums; }
td.text div { white-space: pre-wrap; word-break: break-word; max-height: 14em; overflow: auto;
  font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; }
td.failed div { color: #b00; } td.large { color: #b00; font-weight: 600; } small { color: #666; }
"""

# Nothing may be fetched: inline style and script only, images only as data: URLs (none today).
_POLICY = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:; "
           "form-action 'none'; base-uri 'none'")


def build_report(run_dir: str) -> str:
    """The HTML page of ``run_dir`` (ConfigError when it is no run directory or holds no records)."""
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{run_dir}: no such run directory")
    metrics = [r for r in _rows(run_dir, METRICS_FILE) if isinstance(r.get("step"), int)]
    samples = _rows(run_dir, SAMPLES_FILE)
    if not metrics and not samples:
        raise ConfigError(f"{run_dir}: nothing to report: no rows in {METRICS_FILE} or {SAMPLES_FILE} "
                          f"(is it a run directory? `run_dir` in the recipe)")
    found = series(metrics)
    title = scrub(_title(run_dir))
    info = _run_info(run_dir)
    meta = [html.escape(scrub(os.path.abspath(run_dir)))]
    if isinstance(info.get("global_step"), int):
        meta.append(f"step {info['global_step']}")
    if info.get("exit_status"):
        meta.append(html.escape(scrub(str(info["exit_status"]))))
    if _is_number(info.get("start")):
        meta.append("started " + time.strftime("%Y-%m-%d %H:%M", time.localtime(info["start"])))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_POLICY}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)} · nexrl report</title>
<style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="meta">{" · ".join(meta)}</p>
<h2>Metrics</h2>
<section id="plots">{_plots_html(found)}</section>
<h2>Samples</h2>
<section id="sample-table">{_samples_html(samples, found, large_gap(run_dir))}</section>
<script>{_SCRIPT}</script>
</body></html>
"""


def write_report(run_dir: str, out: str | None = None) -> str:
    """Write ``run_dir``'s page to ``out`` (default ``run_dir/report.html``); returns the path."""
    page = build_report(run_dir)
    out = out or os.path.join(run_dir, REPORT_FILE)
    if os.path.isdir(out):
        raise ConfigError(f"-o {out}: is a folder; give the HTML file to write")
    folder = os.path.dirname(os.path.abspath(out))
    problem = writable_dir_problem(folder, f"-o {out}")
    if problem:
        raise ConfigError(problem)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, out)  # a reader never sees half a page
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ConfigError(f"-o {out}: cannot write it ({(exc.strerror or type(exc).__name__).lower()})") from None
    return out
