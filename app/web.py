"""The web app: FastAPI with the REST API (/api, OpenAPI docs at /api/docs), share links
(/r/<token>), static assets, and the Gradio explorer mounted at "/".

The web process never imports torch: it reads the database and sends Celery tasks by name.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import SQLAlchemyError

from app import services
from compute.contract.settings import Settings, get_settings

ASSETS = Path(__file__).resolve().parent.parent / "frontend_assets"
log = logging.getLogger("fisherlens.web")


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def _message(e: dict[str, Any]) -> str:
    """pydantic's message; for a choice (an enum such as `kind`) the value and the choices."""
    if e.get("type") == "literal_error":
        expected = str((e.get("ctx") or {}).get("expected", "")).replace("'", "")
        return f"got {e.get('input')!r}; accepted: {expected}"
    return str(e.get("msg", "invalid value"))


def create_app(settings: Settings | None = None) -> FastAPI:
    """FastAPI app for `settings` (default: from the environment). Migrates the database."""
    from app.api import make_router
    from app.share import make_share_router

    settings = settings or get_settings()
    services.sessions(settings)  # apply migrations now, not on the first request
    if settings.auth_required:  # verified tokens remembered (PostgreSQL; app/auth/token_cache.py)
        from app.auth import token_cache

        token_cache.enable(settings)
    app = FastAPI(
        title="fisherlens",
        description="Submit Fisher / mask / training / retention / diff / token-explorer jobs, "
        "follow their progress, and read stored results by share token.",
        version="0.1.0",
        docs_url=None,  # served below from local assets (no CDN: works offline)
        redoc_url=None,
        openapi_url="/api/openapi.json",
    )

    # accounts (app/auth/ + app/accounts.py): 401/403 from services, /login, /logout, /api/me,
    # sharing, estimates
    from app import accounts, auth

    _add_error_handlers(app)
    from app.hygiene import InputHygiene

    app.add_middleware(InputHygiene)  # control characters: 4xx before any route (innermost)
    app.add_middleware(_RequestBase)  # share links under the address the request reached us by
    app.add_middleware(auth.AccessGuard, settings=settings)  # body limit, cross-site, sign-in
    app.add_middleware(_RetryAfter)  # outermost: every 429 / 503, whoever answered it
    app.include_router(accounts.make_auth_router(settings))
    app.include_router(make_router(settings))
    from app.explore.api import make_page_router as make_compare_page
    from app.explore.api import make_router as make_explore_router

    app.include_router(make_explore_router(settings))  # drill-down and compare (app/explore/)

    # /r/<token>: the server-rendered share page (app/share.py), outside the Gradio queue
    app.include_router(make_share_router(settings))
    app.include_router(make_compare_page(settings))  # /r/<a>/compare/<b>

    app.mount("/fisherlens-static", StaticFiles(directory=str(ASSETS)), name="assets")
    _offline_docs(app)
    _document_errors(app)
    _method_not_allowed(app)  # after every /api route, before the UI mounted at "/"
    _mount_ui(app, settings)
    return app


class _RetryAfter:
    """ASGI middleware: every 429 and 503 carries Retry-After (30 s where the answer set none:
    the job limit, a download, a service away), so a client knows when to come back."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def sending(msg: Any) -> None:
            if msg["type"] == "http.response.start" and msg.get("status") in (429, 503):
                headers = list(msg.get("headers") or [])
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    msg = {**msg, "headers": [*headers, (b"retry-after", b"30")]}
            await send(msg)

        await self.app(scope, receive, sending)


class _RequestBase:
    """ASGI middleware: services.REQUEST_BASE = the scheme://host this request was addressed to,
    for share links when PUBLIC_URL is not set (route handlers run in a copy of this context)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        token = services.REQUEST_BASE.set(services.base_url(headers, scope.get("scheme") or "http"))
        try:
            await self.app(scope, receive, send)
        finally:
            services.REQUEST_BASE.reset(token)


def _add_error_handlers(app: FastAPI) -> None:
    """422 as {detail: [{field, message}]}, 401/403 from accounts, 500 naming no server path."""
    from app import accounts

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"field": _field(e.get("loc", ())), "message": _message(e)} for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": errors})

    @app.exception_handler(PermissionError)
    async def _denied(request: Request, exc: PermissionError) -> JSONResponse:
        return accounts.login_required_response(exc)

    @app.exception_handler(SQLAlchemyError)
    async def _database(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        from app.auth.guard import DB_DOWN
        from storage.db import is_outage

        if is_outage(exc):  # a short answer; the server log has the address and the error
            log.warning("database unreachable on %s %s: %s", request.method, request.url.path,
                        type(exc).__name__)
            return JSONResponse(status_code=503, content={"detail": DB_DOWN},
                                headers={"Retry-After": "30"})
        return await _server_error(request, exc)

    from storage.artifact_common import ArtifactStoreUnavailable

    @app.exception_handler(ArtifactStoreUnavailable)
    async def _store_down(request: Request, exc: ArtifactStoreUnavailable) -> JSONResponse:
        from app.services.refs import STORE_DOWN

        # a short answer, never the store's address; the server log has it
        log.warning("artifact store unreachable on %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse(status_code=503, content={"detail": STORE_DOWN}, headers={"Retry-After": "30"})

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        # The traceback goes to the server log; the response names no server path.
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(
            status_code=500,
            content={"detail": "internal error; the server log has the details"},
        )


def _method_not_allowed(app: FastAPI) -> None:
    """/api/<anything> that no route serves with this method: 405 with `Allow` (the methods
    the routes of that path do serve) when there are some, else 404, whatever the method (QUERY
    included). Without it the UI mounted at "/" answered 404 for TRACE /api/me."""
    from starlette.routing import Match, Mount

    every = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"]

    def served(scope: Any, method: str) -> bool:
        probe = {**scope, "method": method, "type": "http"}
        for rt in app.router.routes:
            if getattr(rt, "endpoint", None) in (other_method, catch_all):
                continue
            if isinstance(rt, Mount) and not rt.path.startswith("/api"):
                continue  # the UI at "/": it answers every path
            if rt.matches(probe)[0] == Match.FULL:
                return True
        return False

    async def other_method(request: Request) -> JSONResponse:
        allowed = [m for m in every if m != request.method and served(request.scope, m)]
        if not allowed:
            return JSONResponse(status_code=404, content={"detail": "Not Found"})
        return JSONResponse(status_code=405, headers={"Allow": ", ".join(allowed)},
                            content={"detail": f"method {request.method} not allowed here; "
                                     f"allowed: {', '.join(allowed)}"})

    class AnyMethod:
        """An ASGI endpoint (not a function), so its route keeps methods=None and matches every
        method, also ones HTTP adds later (QUERY had fallen through to the UI's 404)."""

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await (await other_method(Request(scope, receive)))(scope, receive, send)

    catch_all = AnyMethod()
    app.router.add_route("/api/{rest:path}", catch_all,  # type: ignore[arg-type]  # ASGI app
                         methods=None, include_in_schema=False)


def _mount_ui(app: FastAPI, settings: Settings) -> None:
    """The Gradio UI at /, every event run as the signed-in user, 4 events at a time."""
    import gradio as gr

    from app import auth
    from app.ui import build_ui

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


def _document_errors(app: FastAPI) -> None:
    """Every /api operation in the OpenAPI schema lists the error statuses any route can answer
    (401/403 from sign-in, 413 from the body limit, 422 in our {detail: [{field, message}]} shape,
    500), each with its body schema; FastAPI's own 422 shape (never sent) is replaced."""
    from fastapi.openapi.utils import get_openapi

    from app.api import ERRORS

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for model, _ in ERRORS.values():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(body.pop("$defs", {}))
            comps[model.__name__] = body
        _job_request_union(comps)
        for path, ops in schema.get("paths", {}).items():
            if not path.startswith("/api/"):
                continue
            for op in ops.values():
                codes = [401, 403, 422, 500] + ([400, 413] if "requestBody" in op else [])
                codes += [404] if "{" in path else []  # an unknown id or token
                resp = op.setdefault("responses", {})
                for code in codes:
                    model, desc = ERRORS[code]
                    doc = {"description": desc, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
                    if code == 422 or str(code) not in resp:
                        resp[str(code)] = doc
        for name in ("HTTPValidationError", "ValidationError"):
            if f'"#/components/schemas/{name}"' not in json.dumps(schema):
                comps.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = build  # type: ignore[method-assign]


def _job_request_union(comps: dict[str, Any]) -> None:
    """POST /api/jobs's body in the schema: one object per job kind (a discriminated union on
    `kind`), its `spec` the kind's own spec model from the job-kind registry
    (compute.jobs.registry: the models the server validates with), not a free-form object."""
    from compute.jobs.registry import KINDS

    variants, mapping = [], {}
    for name, kind in KINDS.items():
        spec = kind.spec.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(spec.pop("$defs", {}))
        comps[kind.spec.__name__] = spec
        title = f"{name.capitalize()}JobRequest"
        comps[title] = {
            "title": title, "type": "object", "additionalProperties": False,
            "required": ["kind", "spec"] if spec.get("required") else ["kind"],
            "properties": {"kind": {"type": "string", "enum": [name]},
                           "spec": {"$ref": f"#/components/schemas/{kind.spec.__name__}"}}}
        variants.append({"$ref": f"#/components/schemas/{title}"})
        mapping[name] = f"#/components/schemas/{title}"
    if "JobRequest" in comps:
        old = comps["JobRequest"]
        comps["JobRequest"] = {"title": "JobRequest", "description": old.get("description", ""),
                               "oneOf": variants,
                               "discriminator": {"propertyName": "kind", "mapping": mapping}}


def _offline_docs(app: FastAPI) -> None:
    """/api/docs: Swagger UI from the assets the fastapi-offline package ships (no CDN)."""
    import fastapi_offline
    from fastapi.openapi.docs import get_swagger_ui_html

    static = Path(fastapi_offline.__file__).resolve().parent / "static"
    app.mount("/api/docs-assets", StaticFiles(directory=str(static)), name="docs-assets")

    @app.get("/api/docs", include_in_schema=False)
    def swagger_ui() -> Any:
        return get_swagger_ui_html(
            openapi_url="/api/openapi.json",
            title="fisherlens API",
            swagger_js_url="/api/docs-assets/swagger-ui-bundle.js",
            swagger_css_url="/api/docs-assets/swagger-ui.css",
            swagger_favicon_url="/fisherlens-static/favicon.svg",
        )


def serve(host: str = "127.0.0.1", port: int = 7860, settings: Settings | None = None) -> None:
    """Run the web app with uvicorn until interrupted (`fisherlens up` calls this)."""
    import uvicorn

    settings = settings or get_settings()
    from app.auth import check_bind

    check_bind(host, settings)  # no open non-loopback server without AUTH_REQUIRED
    # Without PUBLIC_URL, share links use the address each request reached us by
    # (services.share_url), so --host 0.0.0.0 hands out links that work from other machines.
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")
