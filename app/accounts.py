"""/login, /logout, /api/me and the owner's account routes (share link, cost estimate)."""

from __future__ import annotations

import html
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field

from app.auth.guard import SESSION_COOKIE
from app.auth.principal import Forbidden, current_user, db_sessions


def _login_page(message: str = "", next_url: str = "/", status: int = 200) -> HTMLResponse:
    msg = f"<p class='fl-login-error' role='alert'>{html.escape(message)}</p>" if message else ""
    return HTMLResponse(f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>fisherlens: sign in</title><link rel="stylesheet" href="/fisherlens-static/fisherlens.css">
<style>.fl-login{{max-width:22rem;margin:4rem auto;font-family:system-ui,sans-serif}}
.fl-login label{{display:block;margin:.6rem 0 .2rem}}.fl-login input{{width:100%;padding:.4rem}}
.fl-login button{{margin-top:1rem;padding:.45rem 1.2rem}}.fl-login-error{{color:#c92a2a}}</style>
</head><body class="fl-page"><main class="fl-login" id="fl-login"><h1>fisherlens</h1>
<p>Sign in with your user name and password (or an API token from
<code>fisherlens user token NAME</code>).</p>{msg}
<form method="post" action="/login"><input type="hidden" name="next" value="{html.escape(next_url)}">
<label for="fl-name">user name</label><input id="fl-name" name="name" autocomplete="username" required>
<label for="fl-password">password or API token</label>
<input id="fl-password" name="password" type="password" autocomplete="current-password" required>
<button type="submit" id="fl-signin">Sign in</button></form></main></body></html>""",
                        status_code=status)


def _safe_next(url: str | None) -> str:
    url = (url or "/").strip()
    return url if url.startswith("/") and not url.startswith("//") and "\\" not in url else "/"


def make_auth_router(settings: Any) -> APIRouter:
    """/login, /logout, /api/me, /api/jobs/{id}/share and /api/estimate."""
    r = APIRouter()
    _add_sign_in_routes(r, settings)
    _add_account_routes(r, settings)
    return r


def _add_sign_in_routes(r: APIRouter, settings: Any) -> None:
    """/login (form and post: a session cookie) and /logout (revokes it on the server)."""
    secure = settings.public_url.lower().startswith("https://")

    @r.get("/login", include_in_schema=False)
    def login_form(next: str = "/") -> Response:  # noqa: A002 - the query parameter's name
        if not settings.auth_required:
            return RedirectResponse(_safe_next(next), status_code=303)
        return _login_page(next_url=_safe_next(next))

    @r.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        import anyio.to_thread

        form = await request.form()
        name = str(form.get("name") or "").strip()
        password = str(form.get("password") or "")
        next_url = _safe_next(str(form.get("next") or "/"))
        if not settings.auth_required:
            return RedirectResponse(next_url, status_code=303)
        secret = await anyio.to_thread.run_sync(_sign_in, settings, name, password)
        if secret is None:
            return _login_page("Wrong user name or password.", next_url, status=401)
        resp = RedirectResponse(next_url, status_code=303)
        resp.set_cookie(SESSION_COOKIE, secret, max_age=settings.session_max_age_s, httponly=True,
                        samesite="strict", secure=secure, path="/")
        return resp

    def logout(request: Request) -> Response:
        secret = request.cookies.get(SESSION_COOKIE)
        if secret:
            from storage import users

            with db_sessions(settings)() as s:
                users.revoke_secret(session=s, secret=secret)
        resp = RedirectResponse("/login" if settings.auth_required else "/", status_code=303)
        resp.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=secure)
        return resp

    r.add_api_route("/logout", logout, methods=["GET", "POST"], include_in_schema=False)


def _add_account_routes(r: APIRouter, settings: Any) -> None:
    """/api/me, the owner's share-link control and the cost estimate of a spec."""

    @r.get("/api/me", tags=["meta"], summary="Who you are, your limits and your active jobs")
    def me() -> Any:
        from storage import users

        p = current_user(settings)
        with db_sessions(settings)() as s:
            active = users.active_jobs(session=s, owner_id=p.id)
        return {**p.as_dict(), "active_jobs": active, "auth_required": settings.auth_required}

    @r.post("/api/jobs/{job_id}/share", tags=["jobs"],
            summary="Owner: a new share token (the old link answers 404), or the link off / on")
    def share(job_id: int, req: ShareRequest) -> Any:
        from app import services

        try:
            return services.set_sharing(settings, job_id, req.action)
        except LookupError:
            return JSONResponse(status_code=404, content={"detail": f"job: no job with id {job_id}"})

    @r.post("/api/estimate", tags=["jobs"],
            summary="The cost estimate of a spec and the caller's per-job ceiling (nothing queued)")
    def estimate(req: EstimateRequest) -> Any:
        from app import limits
        from compute.contract.specs import SpecError
        from compute.jobs.registry import parse_spec

        p = current_user(settings)
        try:
            limits.check_spec_size(req.spec, max_keys=settings.max_spec_keys,
                                   max_string=settings.max_spec_string)
            spec = parse_spec(req.kind, req.spec)
        except SpecError as exc:
            return JSONResponse(status_code=422, content={"detail": exc.errors})
        est = limits.estimate(settings, req.kind, spec)
        within = p.max_job_cost is None or (est["cost"] is not None and est["cost"] <= p.max_job_cost)
        return {**est, "ceiling": p.max_job_cost, "within_ceiling": within,
                "text": limits.describe(est, p.max_job_cost)}


class ShareRequest(BaseModel):
    action: Literal["new", "off", "on"] = Field(
        ..., description="new: a new token (the old link stops working); off: no link; on: link again")


class EstimateRequest(BaseModel):
    kind: str = Field(..., max_length=32)
    spec: dict[str, Any] = Field(default_factory=dict)


def _sign_in(settings: Any, name: str, password: str) -> str | None:
    """A new session secret for a valid name + password (or name + one of their API tokens)."""
    from storage import users

    with db_sessions(settings)() as s:
        user = users.authenticate(session=s, name=name, password=password)
        if user is None and password.startswith("fl_"):
            tok_user = users.user_for_token(session=s, secret=password, kind="api")
            user = tok_user if tok_user is not None and tok_user.name == name else None
        if user is None:
            return None
        secret, _ = users.issue_token(session=s, user=user, kind="session", label="browser",
                                      ttl_s=settings.session_max_age_s)
        return secret


def login_required_response(exc: PermissionError) -> JSONResponse:
    code = 403 if isinstance(exc, Forbidden) else 401
    headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
    return JSONResponse(status_code=code, content={"detail": str(exc)}, headers=headers)
