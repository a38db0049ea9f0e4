"""The web app: FastAPI with the REST API (/api, OpenAPI docs at /api/docs), share links
(/r/<token>), static assets, and the Gradio explorer mounted at "/".

The web process never imports torch: it reads the database and sends Celery tasks by name.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from app import services
from app.settings import Settings, get_settings

ASSETS = Path(__file__).resolve().parent.parent / "frontend_assets"


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def not_found_page(token: str) -> str:
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>fisherlens: result not found</title><link rel="stylesheet" href="/fisherlens-static/fisherlens.css"></head>
<body class="fl-page"><main class="fl-notfound" id="fl-notfound">
<h1>Result not found</h1>
<p>No fisherlens result has the share link <code>/r/{html.escape(token)}</code>.</p>
<p>Check that the link was copied completely; share links are long random tokens and cannot be
guessed. The result may also have been deleted from this server.</p>
<p><a href="/">Open the fisherlens explorer</a></p></main></body></html>"""


def _token_exists(settings: Settings, token: str) -> bool:
    from storage import repo

    with services.sessions(settings)() as s:
        return repo.get_job_by_token(session=s, token=token) is not None


def create_app(settings: Settings | None = None) -> FastAPI:
    """FastAPI app for `settings` (default: from the environment). Migrates the database."""
    import gradio as gr

    from app.api import make_router
    from app.ui import build_ui

    settings = settings or get_settings()
    services.sessions(settings)  # apply migrations now, not on the first request
    app = FastAPI(
        title="fisherlens",
        description="Submit Fisher / mask / training / retention / diff / token-explorer jobs, "
        "follow their progress, and read stored results by share token.",
        version="0.1.0",
        docs_url="/api/docs",
        redoc_url=None,
        openapi_url="/api/openapi.json",
    )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"field": _field(e.get("loc", ())), "message": e.get("msg", "invalid value")}
                  for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": errors})

    app.include_router(make_router(settings))

    @app.get("/r/{token}", include_in_schema=False)
    def share_link(token: str) -> Any:
        """A share link: the read-only result view for a known token, a clear 404 page otherwise."""
        if not _token_exists(settings, token):
            return HTMLResponse(not_found_page(token), status_code=404)
        return RedirectResponse(f"/?view={token}", status_code=307)

    app.mount("/fisherlens-static", StaticFiles(directory=str(ASSETS)), name="assets")

    blocks = build_ui(settings)
    blocks.queue(default_concurrency_limit=4)
    gr.mount_gradio_app(
        app,
        blocks,
        path="/",
        css_paths=[ASSETS / "fisherlens.css"],
        head='<link rel="icon" href="/fisherlens-static/favicon.svg">'
        '<script src="/fisherlens-static/fisherlens.js" defer></script>',
        footer_links=["settings"],
        run_history=False,
        show_error=True,
        ssr_mode=False,
        mcp_server=False,
    )
    return app


def serve(host: str = "127.0.0.1", port: int = 7860, settings: Settings | None = None) -> None:
    """Run the web app with uvicorn until interrupted (`fisherlens up` calls this)."""
    import uvicorn

    settings = settings or get_settings()
    if "PUBLIC_URL" not in os.environ and "public_url" not in os.environ:
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        settings = settings.model_copy(update={"public_url": f"http://{shown}:{port}"})
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")
