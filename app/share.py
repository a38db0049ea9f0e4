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
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import plotly
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from app import render, services
from app.figures.store import FIGURES_KEY, store_for

PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
PLOTLY_URL = f"/share-static/plotly-{plotly.__version__}.min.js"
# The page is a function of the stored figures and of the code that renders them (this file, app/render.py).
PAGE_KEY = FIGURES_KEY + "." + hashlib.sha256(
    Path(__file__).read_bytes() + Path(render.__file__).read_bytes()).hexdigest()[:8]
# Finished results never change, but an owner may turn a link off (jobs.shared, app/auth/):
# caches keep the page and revalidate each view with its ETag (a 304 costs one indexed read).
FINISHED_CACHE = "public, no-cache"
FINAL = ("succeeded", "failed", "cancelled")
REFRESH_S = 5
PAGE_CSS = """
body{font-family:system-ui,sans-serif;margin:0;background:#f8f9fa;color:#212529}
main{max-width:72rem;margin:0 auto;padding:1rem 1.5rem 3rem}
.fl-shared{background:#fff4e6;border:1px solid #ffd8a8;border-radius:6px;padding:.5rem .75rem}
h1{margin:.75rem 0 .25rem;font-size:1.6rem}
.fl-failed{color:#c92a2a;font-weight:600}
"""


esc = render.esc


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
            f"<style>{PAGE_CSS}{render.CSS}</style>{head_extra}</head><body class=\"fl-share\"><main>{body}</main>"
            "</body></html>")


def _banner(token: str) -> str:
    return ("<div class='fl-shared'>Shared result (read-only). "
            f"<a id='fl-open-app' href='/?view={esc(token)}'>Open it in the interactive explorer</a>"
            " &middot; <a href='/'>fisherlens</a></div>")


def running_page(head: dict[str, Any], token: str) -> str:
    frac = max(0.0, min(1.0, float(head.get("progress") or 0.0)))
    body = (f"{_banner(token)}<h1>{esc(render.title(head))}</h1>"
            f"<p id='fl-status' data-status='{esc(head['status'])}'>This job is <b>{esc(head['status'])}</b>"
            f" ({100 * frac:.0f}%): {esc(services.public_message(head.get('message')))}</p>"
            f"{render.progress_html(head)}"
            f"<p class='fl-meta'>This page reloads every {REFRESH_S} s and shows the result when the "
            "job has finished.</p>")
    return _doc(f"fisherlens: {render.title(head)} ({head['status']})", body,
                f'<meta http-equiv="refresh" content="{REFRESH_S}">')


def check_artifacts(settings: Any, job_id: int, payload: dict[str, Any]) -> dict[str, Any]:
    """The payload with `corrupt: True` on each artifact whose stored file does not match its
    sha256 (issue 21; checked when a page is rendered: the store re-hashes a file only when it
    changed since its last check)."""
    from storage import repo
    from storage.artifacts import ArtifactError, ArtifactStoreUnavailable, open_store

    store = open_store(settings)
    arts = []
    with services.sessions(settings)() as s:
        for a in payload.get("artifacts") or []:
            row = repo.get_artifact(session=s, job_id=job_id, kind=a.get("kind"))
            try:
                if row is not None and store.exists(row.path):
                    store.fetch(row.path, row.sha256)
                arts.append(a)
            except ArtifactError:
                arts.append({**a, "corrupt": True})
            except (OSError, ArtifactStoreUnavailable):
                arts.append(a)  # gone or unreachable (the download says so); not a corruption
    return {**payload, "artifacts": arts}


def result_page(head: dict[str, Any], token: str, payload: dict[str, Any] | None) -> str:
    """The page of a finished job (payload: the stored figures; None for failed/cancelled): the
    banner and title, then app.render's view of the result."""
    parts = [_banner(token), f"<h1>{esc(render.title(head))}</h1>"]
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
        parts.append(render.result_html(payload))
    scripts = (f'<script src="{PLOTLY_URL}" defer></script><script>{render.PAGE_DRAW_JS}</script>'
               if payload else "")
    return _doc(f"fisherlens: {render.title(head)}", "".join(parts), scripts)


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
            if payload is not None:
                payload = check_artifacts(settings, head["id"], payload)  # warn of a corrupt one
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
