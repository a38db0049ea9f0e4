"""The one result renderer: a stored result as HTML, for the share page `/r/<token>` and the
explorer's result tab alike (app/share.py wraps it in a page, app/ui/result.py puts it in one
gr.HTML).

Input: the payload of a finished job (app/figures/store.py: key numbers, Plotly figures with named
layers, tables, artifacts, the public job fields). Order: what the result is, the key numbers
(styled, the reliability verdict and every warning as a banner), the figures, the tables (each
scrolls inside its card), the downloads, and the settings folded away. Pure functions of their
inputs, no Gradio and no server: tests render every stored kind and read the HTML.

Figures travel as Plotly JSON in `<script type="application/json">` inside their `<figure>`
(never executed, never parsed as HTML); `DRAW_JS` draws every figure not yet drawn under a root
with the local plotly.js: on the share page once the document has loaded, in the explorer each
time the view is replaced.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

from app.explore.js import DRAW_FN as DRAW_JS

# The spec FIELDS that say what a result is about, in the order the header names them (field
# names: "fisher" and "mask" here are the reference fields, not job kinds). A share link's job
# names a reference given by server path by its label (app/figures/public.py), never the path.
HEAD_FIELDS = tuple("model base tuned run_dir task algo fisher mask select density precision".split())

_CSS = """
.fl-result{color:#212529;font-size:15px;line-height:1.4}
.fl-result h2{margin:1.25rem 0 .5rem;font-size:1.15rem;font-weight:600}
.fl-result h3{margin:.75rem 0 .25rem;font-size:1rem;font-weight:600}
.fl-result .fl-meta{color:#495057;margin:.25rem 0 .5rem;font-size:.9rem}
.fl-result .fl-meta b{color:#212529}
.fl-result .fl-key{background:#fff;border:1px solid #e9ecef;border-radius:8px;padding:.6rem 1rem .75rem;
 box-shadow:0 1px 6px rgba(0,0,0,.05)}
.fl-result .fl-key h2{margin:.1rem 0 .4rem}
.fl-result dl.fl-nums{display:grid;grid-template-columns:repeat(auto-fill,minmax(14rem,1fr));gap:.6rem 1.25rem;
 margin:.5rem 0 .25rem;padding:0}
.fl-result dl.fl-nums>div{border-left:3px solid #4dabf7;padding:.1rem 0 .1rem .6rem;min-width:0}
.fl-result dl.fl-nums dt{color:#495057;font-size:.8rem;margin:0;line-height:1.25}
.fl-result dl.fl-nums dd{margin:.15rem 0 0;padding:0}
.fl-result .fl-val{display:block;font-size:1.4rem;font-weight:650;line-height:1.2;font-variant-numeric:tabular-nums;
 overflow-wrap:anywhere}
.fl-result .fl-cap{display:block;font-size:.75rem;font-weight:400;color:#868e96;margin-top:.15rem;line-height:1.25}
.fl-result .fl-banner{padding:.45rem .7rem;border-radius:6px;margin:.35rem 0;font-size:.9rem}
.fl-result .fl-good{background:#ebfbee;border:1px solid #8ce99a}
.fl-result .fl-fair{background:#fff9db;border:1px solid #ffe066}
.fl-result .fl-poor,.fl-result .fl-warn{background:#fff5f5;border:1px solid #ffa8a8}
.fl-result .fl-none{background:#f1f3f5;border:1px solid #dee2e6}
.fl-result figure.fl-fig{position:relative;background:#fff;margin:0 0 1rem;padding:.5rem;border:1px solid #e9ecef;
 border-radius:8px;min-height:120px}
.fl-result figure.fl-fig figcaption{position:absolute;width:1px;height:1px;overflow:hidden;clip:rect(0 0 0 0)}
.fl-result .fl-table{background:#fff;border:1px solid #e9ecef;border-radius:8px;padding:.4rem .6rem;margin:0 0 1rem;
 max-width:100%;box-sizing:border-box}
.fl-result .fl-table-title{font-weight:600;font-size:.95rem;margin:.1rem 0 .35rem}
.fl-result .fl-scroll{overflow:auto;max-width:100%;max-height:32rem}
.fl-result table{border-collapse:collapse;font-size:.85rem;margin:0;width:auto;min-width:0}
.fl-result th,.fl-result td{border:1px solid #dee2e6;padding:.2rem .5rem;text-align:left;vertical-align:top;
 white-space:nowrap}
.fl-result thead th{position:sticky;top:0;background:#f1f3f5;z-index:1}
.fl-result td.n{text-align:right;font-variant-numeric:tabular-nums}
.fl-result td.t{white-space:normal;min-width:8rem;max-width:36rem;overflow-wrap:anywhere}
.fl-result .fl-kv{display:inline-block;margin-right:.6rem;white-space:nowrap}
.fl-result .fl-downloads{margin:.5rem 0}.fl-result .fl-downloads a{margin:0 .15rem}
.fl-result details{margin:.5rem 0}.fl-result summary{cursor:pointer;color:#495057}
.fl-result code{background:#f1f3f5;padding:0 .25rem;word-break:break-all}
.fl-result .fl-download-figs{font-size:.8rem;font-weight:400;margin-left:.75rem}
.fl-result figure.fl-fig[data-drill] .fl-plot{cursor:pointer}
.fl-result .fl-table[data-tensors] tbody tr{cursor:pointer}
.fl-result .fl-table[data-tensors] tbody tr:hover{background:#e7f5ff}
.fl-result .fl-tensor{border:2px solid #4dabf7;border-radius:8px;padding:.25rem .75rem .75rem;margin:0 0 1rem;background:#f8fbff}
.fl-result .fl-tensor h2{display:flex;justify-content:space-between;align-items:center;overflow-wrap:anywhere}
.fl-compare-side{min-width:0!important;overflow-x:auto}
.fl-progress{margin:.25rem 0}
.fl-progress .fl-bar{height:14px;background:#e9ecef;border-radius:7px;overflow:hidden;max-width:40rem}
.fl-progress .fl-fill{height:100%;background:#3b5bdb;transition:width .3s}
.fl-progress .fl-fill.fl-succeeded{background:#2b8a3e}
.fl-progress .fl-fill.fl-failed,.fl-progress .fl-fill.fl-cancelled{background:#c92a2a}
.fl-progress .fl-fill.fl-queued{background:#868e96}
.fl-progress .fl-label{font-size:.9rem;margin-top:.2rem}
"""

# Inside Gradio, its `.gradio-container .prose th` rules (specificity 0,2,1) would win over ours:
# each selector repeats its class three times (0,3,x), the same on the share page.
CSS = _CSS.replace(".fl-result", ".fl-result.fl-result.fl-result").replace(".fl-progress", ".fl-progress.fl-progress.fl-progress")

# Draw every figure not drawn yet under `root` (waits for plotly.js if it has not run yet), with
# one Plotly config, SVG export, the drill-down clicks and "download figures" (app/explore/js.py).
DRAW_FN = DRAW_JS
PAGE_DRAW_JS = DRAW_FN + "window.addEventListener('DOMContentLoaded', function () { flDraw(document); });"
# gr.HTML(js_on_load=...): `element` is the component; its value is replaced on every new view.
COMPONENT_DRAW_JS = (DRAW_FN + "new MutationObserver(function () { flDraw(element); })"
                     ".observe(element, {childList: true, subtree: true}); flDraw(element);")


def esc(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def kind_title(kind: Any) -> str:
    """The kind's title from the job-kind registry (compute/jobs/<kind>.py); the name itself
    for a kind this server does not know."""
    from compute.jobs import registry

    k = registry.KINDS.get(str(kind))
    return k.title if k else str(kind)


def title(job: dict[str, Any]) -> str:
    """'Fisher result #3'."""
    return f"{kind_title(job.get('kind'))} result #{job.get('id')}"


# ---------------------------------------------------------------- values and cells


def number(v: float | int) -> str:
    """A number as a table shows it: ints with thousands separators, floats to 4 significant
    digits (scientific below 1e-3 and from 1e5)."""
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if not math.isfinite(v):
        return "n/a"
    if v.is_integer() and abs(v) < 1e15 and abs(v) >= 1:  # a count stored as a float
        return number(int(v))
    return significant(v)


def significant(v: float) -> str:
    """A finite float to 4 significant digits, scientific below 1e-3 and from 1e5; "0" for zero.
    The one float format of the result view: table cells (`number`) and key numbers
    (app/figures/keynumbers.py `fmt`)."""
    if v == 0:
        return "0"
    if abs(v) < 1e-3 or abs(v) >= 1e5:
        return f"{v:.3e}"
    return f"{v:.4g}"


def plain(v: Any) -> str:
    """Any stored value as text a person reads: no Python or JSON punctuation ({'a': 1} ->
    'a 1', [1, 2] -> '1, 2'); escaped HTML."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        return number(v)
    if isinstance(v, dict):
        return " ".join(f"<span class='fl-kv'>{esc(k)} <b>{plain(x)}</b></span>" for k, x in v.items())
    if isinstance(v, list | tuple):
        if all(isinstance(x, dict) for x in v) and v:
            return "; ".join(plain(x) for x in v)
        return ", ".join(plain(x) for x in v)
    return esc(v)


def cell(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return f"<td>{plain(v)}</td>"
    if isinstance(v, int | float):
        return f"<td class='n'>{plain(v)}</td>"
    if isinstance(v, str) and len(v) <= 40:
        return f"<td>{esc(v)}</td>"
    return f"<td class='t'>{plain(v)}</td>"


def table_html(headers: list[Any], rows: list[list[Any]], caption: str = "", elem_id: str = "") -> str:
    """One table in its card; the card scrolls (both ways) when the table is wider or longer."""
    cap = f"<div class='fl-table-title'>{esc(caption)}</div>" if caption else ""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    idattr = f" id='{esc(elem_id)}'" if elem_id else ""
    return (f"<div class='fl-table'{idattr}>{cap}<div class='fl-scroll'><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table></div></div>")


# ---------------------------------------------------------------- parts of the view


def meta_line(job: dict[str, Any]) -> str:
    """What the result is about: model / base / tuned / ... and when it finished."""
    spec = job.get("spec") or {}
    bits = [f"{esc(k)} <b>{plain(spec[k])}</b>" for k in HEAD_FIELDS if spec.get(k) not in (None, "", [])]
    when = (job.get("finished_at") or job.get("created_at") or "")[:19].replace("T", " ")
    end = f"finished {esc(when)} UTC" if job.get("finished_at") else (f"created {esc(when)} UTC" if when else "")
    return f"<p class='fl-meta'>{', '.join(bits)}{'; ' if bits and end else ''}{end}</p>"


def key_section(numbers: dict[str, Any]) -> str:
    """The key numbers card: reliability verdict and warnings as banners, then the numbers (label
    above, value large, its note below), then the key table."""
    parts = ["<section id='fl-key' class='fl-key'><h2>Key numbers</h2>"]
    v = numbers.get("verdict")
    if v:
        parts.append(f"<div id='fl-verdict' class='fl-banner fl-verdict fl-{esc(v.get('level'))}'>"
                     f"<b>Reliability:</b> {esc(v.get('text'))}</div>")
    for w in numbers.get("warnings") or []:
        parts.append(f"<div class='fl-banner fl-warn' role='note'><b>Warning:</b> {esc(w)}</div>")
    items = numbers.get("items") or []
    if items:
        parts.append("<dl class='fl-nums'>" + "".join(
            f"<div><dt>{esc(i.get('label'))}</dt><dd><span class='fl-val'>{esc(i.get('value'))}</span>"
            + (f"<span class='fl-cap'>{esc(i['note'])}</span>" if i.get("note") else "") + "</dd></div>"
            for i in items) + "</dl>")
    t = numbers.get("table")
    if t and t.get("rows"):
        parts.append(table_html(t.get("headers") or [], t["rows"], t.get("title", "")))
    if not items and not v and not (t and t.get("rows")):
        parts.append("<p class='fl-meta'>This kind of result has no headline numbers; see the "
                     "figures and tables below.</p>")
    return "".join(parts) + "</section>"


def _script_json(obj: Any) -> str:
    """JSON safe inside <script type="application/json">: '<', '>' and '&' only occur inside
    strings, where their \\u escapes mean the same."""
    return (json.dumps(obj, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def drillable(fig: dict[str, Any]) -> bool:
    """A layer x module heatmap: its cells open their tensors (app/explore/)."""
    layout = fig.get("layout") or {}

    def axis_title(ax: str) -> str:
        t = (layout.get(ax) or {}).get("title")
        return str((t.get("text") if isinstance(t, dict) else t) or "")

    return (any(tr.get("type") == "heatmap" for tr in fig.get("data") or [])
            and axis_title("yaxis") == "layer" and axis_title("xaxis").startswith("module"))


def file_stem(title: Any, i: int) -> str:
    """A figure's export file name: its title in lower-case words joined by '-' (at most 60
    characters), 'figure-<i>' without one."""
    words = "".join(c if c.isalnum() else " " for c in str(title or "").lower()).split()
    return "-".join(words)[:60].strip("-") or f"figure-{i}"


def figures_html(figures: list[dict[str, Any]], prefix: str = "fl-fig") -> str:
    """Stored figures ({name, title, figure}) as `<figure id='{prefix}-{i}'>` blocks, each with its
    Plotly JSON beside the element it is drawn into (`DRAW_FN`); a layer x module heatmap is
    marked `data-drill` (a click on a cell opens its tensor)."""
    return "".join(
        f"<figure class='fl-fig' id='{esc(prefix)}-{i}' data-name='{esc(file_stem(f.get('title'), i))}'"
        f"{' data-drill' if drillable(f['figure']) else ''}>"
        f"<figcaption>{esc(f.get('title'))}</figcaption><div class='fl-plot'></div>"
        f"<script type='application/json' id='{esc(prefix)}-{i}-data' class='fl-fig-data'>"
        f"{_script_json(f['figure'])}</script></figure>"
        for i, f in enumerate(figures))


GROUP_HEADERS = ["group", "quantity", "value"]  # app/figures/tables.py: one card per group
SETTINGS_TITLE = "Settings of this run"  # app/figures/tables.py: folded away


def _grouped(t: dict[str, Any]) -> str:
    """A (group, quantity, value) table as one card per group, the ungrouped rows first."""
    groups: dict[str, list[list[Any]]] = {}
    for g, q, v in t.get("rows") or []:
        groups.setdefault(str(g or ""), []).append([q, v])
    out = []
    for g, rows in groups.items():
        title = (t.get("title") or "") if not g else g
        out.append(table_html(["quantity", "value"], rows, title))
    return "".join(out)


def tables_html(tables: list[dict[str, Any]]) -> str:
    """The result's tables; one whose first column is "tensor" is marked `data-tensors` (a click
    on a row opens that tensor, app/explore/); a (group, quantity, value) table is one card per
    group; the settings table is folded away."""
    out = []
    for t in tables:
        headers = list(t.get("headers") or [])
        if headers == GROUP_HEADERS:
            h = _grouped(t)
        else:
            h = table_html(headers, t.get("rows") or [], t.get("title") or "")
        if headers[:1] == ["tensor"]:
            h = h.replace("<div class='fl-table'>", "<div class='fl-table' data-tensors>", 1)
        if t.get("title") == SETTINGS_TITLE:
            h = f"<details class='fl-run-settings'><summary>{esc(SETTINGS_TITLE)}</summary>{h}</details>"
        out.append(h)
    return "".join(out)


def downloads_html(job: dict[str, Any], artifacts: list[dict[str, Any]]) -> str:
    token = esc(job.get("share_token"))
    links = [f"<a href='/api/results/{token}/stats.csv' download>stats CSV</a>",
             f"<a href='/api/results/{token}/stats.json' download>stats JSON</a>",
             f"<a href='/api/results/{token}' target='_blank'>raw JSON</a>"]
    for a in artifacts:
        ext = "zip" if a.get("is_dir") else "safetensors"
        links.append(f"<a href='/api/results/{token}/artifacts/{esc(a.get('kind'))}' download>"
                     f"{esc(a.get('kind'))} ({ext}, {(a.get('bytes') or 0) / 1e6:.2f} MB)</a>"
                     + (" <b class='fl-corrupt'>(corrupt)</b>" if a.get("corrupt") else ""))
    # share.check_artifacts marks an artifact whose stored bytes fail their sha256
    bad = [esc(a.get("kind")) for a in artifacts if a.get("corrupt")]
    warning = (f"<p id='fl-artifact-warning' class='fl-failed' role='alert'>Warning: the stored "
               f"{', '.join(bad)} artifact does not match its recorded sha256 (corrupt or changed "
               "on disk); its download is refused. Re-run the job to make it again.</p>"
               if bad else "")
    return (warning + "<p id='fl-downloads' class='fl-downloads'>Downloads: "
            + " &middot; ".join(links) + "</p>")


def settings_html(spec: dict[str, Any]) -> str:
    if not spec:
        return ""
    rows = [[k, "none" if v is None else v] for k, v in spec.items()]
    return ("<details id='fl-settings'><summary>Settings of this run</summary>"
            + table_html(["setting", "value"], rows) + "</details>")


def result_html(payload: dict[str, Any], job: dict[str, Any] | None = None,
                max_figures: int | None = None, fig_prefix: str = "fl-fig") -> str:
    """The view of one finished result: meta line, key numbers, figures, tables, downloads,
    settings. `payload`: app/figures/store.py's; `job`: the job fields (default: the payload's);
    `max_figures`: show only the first ones (the explorer), None = all (the share page)."""
    job = job or payload.get("job") or {}
    token = esc(job.get("share_token"))
    download = esc(f"{job.get('kind')}-{job.get('id')}")
    parts = [f"<div class='fl-result' data-token='{token}' data-download='{download}'>", meta_line(job),
             key_section(payload.get("numbers") or {})]
    figs = payload.get("figures") or []
    if figs:
        shown = figs if max_figures is None else figs[:max_figures]
        more = (f"<p class='fl-meta'>{len(figs) - len(shown)} more figures on the share page.</p>"
                if len(shown) < len(figs) else "")
        parts.append(f"<section id='fl-figures'><h2>Figures <a href='#' class='fl-download-figs' "
                     f"id='fl-download-figs'>download figures (SVG, zip)</a></h2>"
                     f"{figures_html(shown, fig_prefix)}{more}</section>")
    tables = payload.get("tables") or []
    if tables:
        parts.append(f"<section id='fl-tables'><h2>Tables</h2>{tables_html(tables)}</section>")
    if not figs and not tables:
        parts.append("<p class='fl-meta'>This result has no figures or tables.</p>")
    parts.append(downloads_html(job, payload.get("artifacts") or []))
    parts.append(settings_html(job.get("spec") or {}))
    return "".join(parts) + "</div>"


def progress_html(job: dict[str, Any] | None, message: str = "") -> str:
    """A progress bar with data-status / data-progress / data-job attributes (tests wait on
    them); `message`: the job's public one-line message."""
    if job is None:
        return "<div class='fl-progress' data-status='none'><div class='fl-label'>no job selected</div></div>"
    status = job.get("status", "queued")
    frac = 1.0 if status == "succeeded" else float(job.get("progress") or 0.0)
    pct = max(0.0, min(100.0, 100.0 * frac))
    what = f"{kind_title(job.get('kind'))} #{job.get('id')}"
    # a live clock while it waits or runs (frontend_assets/fisherlens.js ticks it every second),
    # so a long stage (loading a model) visibly is not a stuck page
    since = job.get("started_at") if status == "running" else job.get("created_at") if status == "queued" else None
    clock = (f" <span class='fl-elapsed' data-since='{esc(since)}' data-what='{'running' if status == 'running' else 'waiting'}'>"
             "</span>" if since else "")
    return (f"<div class='fl-progress' data-status='{esc(status)}' data-progress='{frac:.4f}' "
            f"data-job='{esc(job.get('id'))}'>"
            f"<div class='fl-bar'><div class='fl-fill fl-{esc(status)}' style='width:{pct:.1f}%'></div></div>"
            f"<div class='fl-label'><b>{esc(what)}</b> <span class='fl-status fl-{esc(status)}'>{esc(status)}"
            f"</span> {pct:.0f}%{' &middot; ' + esc(message) if message else ''}{clock}</div></div>")
