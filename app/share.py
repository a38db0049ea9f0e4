"""The share page `/r/<token>`: a server-rendered HTML page of one result, for anyone with the link.

Plain FastAPI (no Gradio queue): one indexed read of the job's status, then the page. A finished
job's page is immutable, so it is built once per process from the stored figures
(`app/figures/store.py`, built once per job) and served with a strong ETag, `Cache-Control`,
and gzip; `If-None-Match` answers 304. A queued or running job gets a page that says so and
refreshes itself, never cached. A failed job shows its one-line cause, never a traceback or a
server path. The figures are Plotly JSON inside the HTML, drawn by the plotly.js that the
plotly package ships (served here, no CDN).

Order of the page: key numbers (with the reliability verdict and warnings), figures, tables,
downloads and the settings the result used; a link opens the same result in the explorer.
"""

from __future__ import annotations

import gzip
import hashlib
import html
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import plotly
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from app import services
from app.figures.store import FIGURES_KEY, store_for
from compute.jobs import registry

PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
PLOTLY_URL = f"/share-static/plotly-{plotly.__version__}.min.js"
PAGE_KEY = FIGURES_KEY + "." + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]
# Finished results never change, but an owner may turn a link off (jobs.shared, app/auth/):
# caches keep the page and revalidate each view with its ETag (a 304 costs one indexed read).
FINISHED_CACHE = "public, no-cache"
FINAL = ("succeeded", "failed", "cancelled")
REFRESH_S = 5

CSS = """
body{font-family:system-ui,sans-serif;margin:0;background:#f8f9fa;color:#212529}
main{max-width:72rem;margin:0 auto;padding:1rem 1.5rem 3rem}
.fl-shared{background:#fff4e6;border:1px solid #ffd8a8;border-radius:6px;padding:.5rem .75rem}
h1{margin:.75rem 0 .25rem}h2{margin:1.5rem 0 .5rem;font-size:1.2rem}
.fl-meta{color:#495057;margin:.25rem 0}
.fl-key{background:#fff;border-radius:8px;padding:.75rem 1rem;box-shadow:0 1px 6px rgba(0,0,0,.06)}
.fl-key dl{display:grid;grid-template-columns:repeat(auto-fill,minmax(15rem,1fr));gap:.5rem 1.5rem;margin:.5rem 0}
.fl-key dt{color:#495057;font-size:.85rem}.fl-key dd{margin:0;font-size:1.35rem;font-weight:600}
.fl-key dd small{display:block;font-size:.75rem;font-weight:400;color:#868e96}
.fl-verdict{padding:.4rem .6rem;border-radius:6px;margin:.25rem 0}
.fl-good{background:#ebfbee;border:1px solid #8ce99a}.fl-fair{background:#fff9db;border:1px solid #ffe066}
.fl-poor,.fl-warn{background:#fff5f5;border:1px solid #ffa8a8}.fl-none{background:#f1f3f5}
.fl-warn{padding:.4rem .6rem;border-radius:6px;margin:.25rem 0}
figure.fl-fig{position:relative;background:#fff;margin:0 0 1rem;padding:.5rem;border-radius:8px;box-shadow:0 1px 6px rgba(0,0,0,.06)}
figure.fl-fig figcaption{position:absolute;width:1px;height:1px;overflow:hidden;clip:rect(0 0 0 0)}
table{border-collapse:collapse;background:#fff;font-size:.85rem;margin:.25rem 0 1rem}
caption{text-align:left;font-weight:600;padding:.25rem 0}th,td{border:1px solid #dee2e6;padding:.2rem .45rem;text-align:left}td.n{text-align:right}
.fl-scroll{overflow-x:auto}
.fl-bar{height:14px;background:#e9ecef;border-radius:7px;overflow:hidden;max-width:30rem}
.fl-fill{height:100%;background:#4dabf7}
.fl-failed{color:#c92a2a;font-weight:600}
code{background:#f1f3f5;padding:0 .25rem;word-break:break-all}
"""

DRAW_JS = """
window.addEventListener('DOMContentLoaded', function () {
  document.querySelectorAll('figure.fl-fig').forEach(function (f) {
    var fig = JSON.parse(document.getElementById(f.id + '-data').textContent);
    var el = f.querySelector('.fl-plot');
    Plotly.newPlot(el, fig.data || [], fig.layout || {}, {responsive: true, displaylogo: false});
  });
});
"""

def esc(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def not_found_page(token: str) -> str:
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>fisherlens: result not found</title><link rel="stylesheet" href="/fisherlens-static/fisherlens.css"></head>
<body class="fl-page"><main class="fl-notfound" id="fl-notfound">
<h1>Result not found</h1>
<p>No fisherlens result has the share link <code>/r/{esc(token)}</code>.</p>
<p>Check that the link was copied completely; share links are long random tokens and cannot be
guessed. The result may also have been deleted from this server.</p>
<p><a href="/">Open the fisherlens explorer</a></p></main></body></html>"""


def _doc(title: str, body: str, head_extra: str = "") -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{esc(title)}</title><link rel=\"icon\" href=\"/fisherlens-static/favicon.svg\">"
            f"<style>{CSS}</style>{head_extra}</head><body class=\"fl-share\"><main>{body}</main>"
            "</body></html>")


def _banner(token: str) -> str:
    return ("<div class='fl-shared'>Shared result (read-only). "
            f"<a id='fl-open-app' href='/?view={esc(token)}'>Open it in the interactive explorer</a>"
            " &middot; <a href='/'>fisherlens</a></div>")


def _title(head: dict[str, Any]) -> str:
    kind = registry.KINDS.get(head["kind"])
    return f"{kind.title if kind else head['kind']} result #{head['id']}"


def running_page(head: dict[str, Any], token: str) -> str:
    frac = max(0.0, min(1.0, float(head.get("progress") or 0.0)))
    body = (f"{_banner(token)}<h1>{esc(_title(head))}</h1>"
            f"<p id='fl-status' data-status='{esc(head['status'])}'>This job is <b>{esc(head['status'])}</b>"
            f" ({100 * frac:.0f}%): {esc(services.public_message(head.get('message')))}</p>"
            f"<div class='fl-bar'><div class='fl-fill' style='width:{100 * frac:.1f}%'></div></div>"
            f"<p class='fl-meta'>This page reloads every {REFRESH_S} s and shows the result when the "
            "job has finished.</p>")
    return _doc(f"fisherlens: {_title(head)} ({head['status']})", body,
                f'<meta http-equiv="refresh" content="{REFRESH_S}">')


def _script_json(obj: Any) -> str:
    """JSON safe inside <script type="application/json">: '<', '>' and '&' only occur inside
    strings, where their \\u escapes mean the same."""
    return (json.dumps(obj, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def _cell(v: Any) -> str:
    if v is None:
        return "<td></td>"
    if isinstance(v, bool):
        return f"<td>{esc(v)}</td>"
    if isinstance(v, int | float):
        return f"<td class='n'>{esc(v)}</td>"
    return f"<td>{esc(v)}</td>"


def _table(headers: list[str], rows: list[list[Any]], caption: str = "") -> str:
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<div class='fl-scroll'><table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def key_section(numbers: dict[str, Any]) -> str:
    parts = ["<section id='fl-key' class='fl-key'><h2>Key numbers</h2>"]
    v = numbers.get("verdict")
    if v:
        parts.append(f"<div id='fl-verdict' class='fl-verdict fl-{esc(v['level'])}'>"
                     f"<b>Reliability:</b> {esc(v['text'])}</div>")
    for w in numbers.get("warnings") or []:
        parts.append(f"<div class='fl-warn'><b>Warning:</b> {esc(w)}</div>")
    items = numbers.get("items") or []
    if items:
        parts.append("<dl>" + "".join(
            f"<div><dt>{esc(i['label'])}</dt><dd>{esc(i['value'])}"
            + (f"<small>{esc(i['note'])}</small>" if i.get("note") else "") + "</dd></div>"
            for i in items) + "</dl>")
    t = numbers.get("table")
    if t and t.get("rows"):
        parts.append(_table(t["headers"], t["rows"], t.get("title", "")))
    if not items and not v and not (t and t.get("rows")):
        parts.append("<p class='fl-meta'>This kind of result has no headline numbers; see the "
                     "figures and tables below.</p>")
    return "".join(parts) + "</section>"


def _downloads(job: dict[str, Any], artifacts: list[dict[str, Any]]) -> str:
    token = esc(job.get("share_token"))
    links = [f"<a href='/api/results/{token}/stats.csv' download>stats CSV</a>",
             f"<a href='/api/results/{token}/stats.json' download>stats JSON</a>",
             f"<a href='/api/results/{token}'>raw JSON</a>"]
    for a in artifacts:
        ext = "zip" if a.get("is_dir") else "safetensors"
        links.append(f"<a href='/api/results/{token}/artifacts/{esc(a.get('kind'))}' download>"
                     f"{esc(a.get('kind'))} ({ext}, {(a.get('bytes') or 0) / 1e6:.2f} MB)</a>")
    return "<p id='fl-downloads'>Downloads: " + " &middot; ".join(links) + "</p>"


def _meta_line(job: dict[str, Any]) -> str:
    spec = job.get("spec") or {}
    bits = [f"{k} <b>{esc(spec[k])}</b>" for k in ("model", "task", "algo", "base", "tuned")
            if spec.get(k)]
    when = (job.get("finished_at") or "")[:19].replace("T", " ")
    return f"<p class='fl-meta'>{', '.join(bits)}{'; ' if bits else ''}finished {esc(when)} UTC</p>"


def result_page(head: dict[str, Any], token: str, payload: dict[str, Any] | None) -> str:
    """The page of a finished job (payload: the stored figures; None for failed/cancelled)."""
    job = (payload or {}).get("job") or head
    parts = [_banner(token), f"<h1>{esc(_title(head))}</h1>"]
    if head["status"] == "failed":
        parts.append(f"<p id='fl-status' data-status='failed' class='fl-failed'>This job failed: "
                     f"{esc(services.public_message(head.get('message')))}</p>")
    elif head["status"] == "cancelled":
        parts.append(f"<p id='fl-status' data-status='cancelled'>This job was cancelled "
                     f"({esc(services.public_message(head.get('message')))}); it has no result.</p>")
    elif payload is None:
        parts.append("<p id='fl-status' data-status='missing'>The rows of this result are gone "
                     "from the database.</p>")
    else:
        parts.append(_meta_line(job))
        parts.append(key_section(payload.get("numbers") or {}))
        figs = payload.get("figures") or []
        if figs:
            parts.append("<section id='fl-figures'><h2>Figures</h2>")
            for i, f in enumerate(figs):
                parts.append(f"<figure class='fl-fig' id='fl-fig-{i}'><figcaption>{esc(f['title'])}"
                             "</figcaption><div class='fl-plot'></div></figure>"
                             f"<script type='application/json' id='fl-fig-{i}-data'>"
                             f"{_script_json(f['figure'])}</script>")
            parts.append("</section>")
        tables = payload.get("tables") or []
        if tables:
            parts.append("<section id='fl-tables'><h2>Tables</h2>")
            parts += [f"<h3>{esc(t['title'])}</h3>{_table(t['headers'], t['rows'])}" for t in tables]
            parts.append("</section>")
        parts.append(_downloads(job, payload.get("artifacts") or []))
        spec = job.get("spec") or {}
        if spec:
            parts.append("<details><summary>Settings of this run</summary>"
                         + _table(["setting", "value"], [[k, _plain(v)] for k, v in spec.items()])
                         + "</details>")
    scripts = f'<script src="{PLOTLY_URL}" defer></script><script>{DRAW_JS}</script>' if payload else ""
    return _doc(f"fisherlens: {_title(head)}", "".join(parts), scripts)


def _plain(v: Any) -> Any:
    return json.dumps(v) if isinstance(v, list | dict) else v


def etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    if header.strip() == "*":
        return True
    return any(t.strip().removeprefix("W/") == etag for t in header.split(","))


class PageCache:
    """Rendered pages of finished jobs, keyed by ETag (LRU, bounded by bytes): a page is an
    immutable function of its ETag, so it is rendered and gzipped once per process."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self._pages: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, etag: str) -> tuple[bytes, bytes] | None:
        with self._lock:
            page = self._pages.get(etag)
            if page is not None:
                self._pages.move_to_end(etag)
            return page

    def put(self, etag: str, text: str) -> tuple[bytes, bytes]:
        raw = text.encode()
        page = (raw, gzip.compress(raw, 6))
        with self._lock:
            if etag not in self._pages:
                self._pages[etag] = page
                self._size += len(page[0]) + len(page[1])
            while self._size > self.max_bytes and len(self._pages) > 1:
                _, (a, b) = self._pages.popitem(last=False)
                self._size -= len(a) + len(b)
        return page


def make_share_router(settings: Any) -> APIRouter:
    """GET /r/{token} (the page) and GET /share-static/plotly-<version>.min.js."""
    from sqlalchemy.exc import DBAPIError

    from storage import repo
    from storage.db import make_engine

    router = APIRouter()
    services.sessions(settings)  # migrated before the first view
    # Its own pool without pre-ping (a second round trip per view on PostgreSQL); a connection
    # that died (database restarted) is retried once on a fresh one instead.
    engine = make_engine(settings.db_url, pool_pre_ping=False)
    store = store_for(settings)
    pages = PageCache()

    def job_head(token: str) -> dict[str, Any] | None:
        for attempt in (1, 2):
            try:
                with engine.connect() as conn:  # a plain Connection: no ORM session per view
                    return repo.job_head_by_token(session=conn, token=token)
            except DBAPIError as exc:
                if attempt == 2 or not exc.connection_invalidated:
                    raise
        return None  # not reached

    @router.get("/r/{token}", include_in_schema=False)
    def share_page(token: str, request: Request) -> Response:
        head = job_head(token)
        if head is None:
            return HTMLResponse(not_found_page(token), status_code=404,
                                headers={"Cache-Control": "no-store"})
        if head["status"] not in FINAL:
            return HTMLResponse(running_page(head, token), headers={"Cache-Control": "no-store"})
        etag = f'"{head["id"]}-{(head["finished_at"] or "").replace(":", "")}-{PAGE_KEY}"'
        headers = {"ETag": etag, "Cache-Control": FINISHED_CACHE, "Vary": "Accept-Encoding"}
        if etag_matches(request.headers.get("if-none-match"), etag):
            return Response(status_code=304, headers=headers)
        page = pages.get(etag)
        if page is None:
            payload = None
            if head["status"] == "succeeded":
                payload = store.get(head["id"], head["finished_at"],
                                    lambda: services.result_by_token(settings, token))
            page = pages.put(etag, result_page(head, token, payload))
        if "gzip" in request.headers.get("accept-encoding", ""):
            return Response(page[1], media_type="text/html; charset=utf-8",
                            headers={**headers, "Content-Encoding": "gzip"})
        return Response(page[0], media_type="text/html; charset=utf-8", headers=headers)

    _add_plotly_route(router)
    return router


def _add_plotly_route(router: APIRouter) -> None:
    """GET /share-static/plotly-<version>.min.js: the plotly package's own file, immutable."""
    plotly_gz: list[bytes] = []  # gzipped once, on first request (4.8 MB -> about 1.4 MB)

    @router.get(PLOTLY_URL, include_in_schema=False)
    def plotly_js(request: Request) -> Response:
        headers = {"Cache-Control": "public, max-age=31536000, immutable", "Vary": "Accept-Encoding"}
        if "gzip" not in request.headers.get("accept-encoding", ""):
            return FileResponse(PLOTLY_JS, media_type="text/javascript", headers=headers)
        if not plotly_gz:
            plotly_gz.append(gzip.compress(PLOTLY_JS.read_bytes(), 6))
        return Response(plotly_gz[0], media_type="text/javascript",
                        headers={**headers, "Content-Encoding": "gzip"})
