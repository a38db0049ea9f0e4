"""The web app: FastAPI with the REST API (/api, OpenAPI docs at /api/docs), share links
(/r/<token>), static assets, and the Gradio explorer mounted at "/".

The web process never imports torch: it reads the database and sends Celery tasks by name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from app import services
from app.settings import Settings, get_settings

ASSETS = Path(__file__).resolve().parent.parent / "frontend_assets"


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def create_app(settings: Settings | None = None) -> FastAPI:
    """FastAPI app for `settings` (default: from the environment). Migrates the database."""
    import gradio as gr

    from app.api import make_router
    from app.share import make_share_router
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

    # accounts (app/auth.py): 401/403 from services, /login, /logout, /api/me, sharing, estimates
    from app import auth

    @app.exception_handler(PermissionError)
    async def _denied(request: Request, exc: PermissionError) -> JSONResponse:
        return auth.login_required_response(exc)

    app.add_middleware(auth.AccessGuard, settings=settings)  # body limit, cross-site, sign-in
    app.include_router(auth.make_auth_router(settings))
    app.include_router(make_router(settings))

    # /r/<token>: the server-rendered share page (app/share.py), outside the Gradio queue
    app.include_router(make_share_router(settings))

    app.mount("/fisherlens-static", StaticFiles(directory=str(ASSETS)), name="assets")

    blocks = build_ui(settings)
    auth.bind_gradio_users(blocks, settings)  # UI events run as the signed-in user
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
        auth_dependency=auth.gradio_user(settings),
    )
    return app


def serve(host: str = "127.0.0.1", port: int = 7860, settings: Settings | None = None) -> None:
    """Run the web app with uvicorn until interrupted (`fisherlens up` calls this)."""
    import uvicorn

    settings = settings or get_settings()
    from app.auth import check_bind

    check_bind(host, settings)  # no open non-loopback server without AUTH_REQUIRED
    if "PUBLIC_URL" not in os.environ and "public_url" not in os.environ:
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        settings = settings.model_copy(update={"public_url": f"http://{shown}:{port}"})
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")
