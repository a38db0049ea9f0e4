"""/login, /logout, /api/me and the owner's account routes (share link, cost estimate)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Path, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field

from app.api import JobKind
from app.auth import throttle
from app.auth.guard import SESSION_COOKIE
from app.auth.principal import Forbidden, current_user, db_sessions


@dataclass(frozen=True)
class Throttled:
    """A refused attempt: wait this many seconds (Retry-After)."""

    retry_after: int


class _HashGate:
    """Password checks (argon2: ~50 ms of a core and 64 MB each) run in at most
    SIGNIN_THREADS threads of their own, so a flood of sign-ins cannot take the threads every
    other request needs; at most SIGNIN_BACKLOG wait, the rest get 429 at once. Each attempt is
    reserved against its account's and address's windows before any hashing
    (app/auth/throttle.py `reserve`): a failure keeps it, a success gives it back."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.waiting = 0
        self._limiter: Any = None

    async def run(self, keys: list[throttle.Key], fn: Any, *args: Any) -> Any:
        """fn(*args) -> its result, None (a failed check: counted against `keys`), or
        Throttled (throttled or too busy: nothing was hashed)."""
        import anyio
        import anyio.to_thread

        limits = throttle.signin_throttle(self.settings)
        reserved = await anyio.to_thread.run_sync(limits.reserve, keys)  # counted before hashing
        if isinstance(reserved, int):
            return Throttled(reserved)
        if self.waiting >= self.settings.signin_backlog:
            await anyio.to_thread.run_sync(limits.release, reserved)  # never made: given back
            return Throttled(1)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.settings.signin_threads)
        self.waiting += 1
        try:
            out = await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except Exception:  # the check itself broke: no attempt was judged
            await anyio.to_thread.run_sync(limits.release, reserved)
            raise
        finally:
            self.waiting -= 1
        if out is not None:  # a success: the account starts afresh, the address's attempt back
            await anyio.to_thread.run_sync(limits.clear, keys[:1])
            await anyio.to_thread.run_sync(limits.release, reserved)
        return out


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
    _add_session_routes(r, settings)
    return r


def _add_sign_in_routes(r: APIRouter, settings: Any) -> None:
    """/login (form and post: a session cookie) and /logout (revokes it on the server)."""
    secure = settings.public_url.lower().startswith("https://")

    @r.get("/login", include_in_schema=False)
    def login_form(next: str = "/") -> Response:  # noqa: A002 - the query parameter's name
        if not settings.auth_required:
            return RedirectResponse(_safe_next(next), status_code=303)
        return _login_page(next_url=_safe_next(next))

    gate = _HashGate(settings)

    @r.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        form = await request.form()
        name = str(form.get("name") or "").strip()[:200]
        password = str(form.get("password") or "")[:1024]
        next_url = _safe_next(str(form.get("next") or "/"))
        if not settings.auth_required:
            return RedirectResponse(next_url, status_code=303)
        keys = [throttle.account_key(name), throttle.address_key("signin-ip", throttle.client_address(request.scope))]
        outcome = await gate.run(keys, _sign_in, settings, name, password)
        if isinstance(outcome, Throttled):  # throttled or too busy: refused before any hashing
            page = _login_page(throttle.too_many(outcome.retry_after, "sign-ins"), next_url,
                               status=429)
            page.headers["Retry-After"] = str(outcome.retry_after)
            return page
        if outcome is None:
            return _login_page("Wrong user name or password.", next_url, status=401)
        resp = RedirectResponse(next_url, status_code=303)
        resp.set_cookie(SESSION_COOKIE, outcome, max_age=settings.session_max_age_s, httponly=True,
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
        est = limits.estimate(settings, req.kind, spec, limits.refs_for_estimate(settings, req.kind, spec))
        within = limits.within_ceiling(est, p.max_job_cost, p.max_job_seconds)
        return {**est, "ceiling": p.max_job_cost, "ceiling_seconds": p.max_job_seconds,
                "within_ceiling": within,
                "text": limits.describe(est, p.max_job_cost, p.max_job_seconds)}


def _add_session_routes(r: APIRouter, settings: Any) -> None:
    """A user's own password change (ends their other sessions) and an admin's "end every
    session of this user"."""
    gate = _HashGate(settings)

    @r.post("/api/me/password", tags=["meta"], responses=_responses(401, 403, 422, 429),
            summary="Change your password: every other browser session of yours ends")
    async def change_password(req: PasswordChange, request: Request) -> Any:
        p = current_user(settings)
        keys = [throttle.account_key(p.name),
                throttle.address_key("signin-ip", throttle.client_address(request.scope))]
        outcome = await gate.run(keys, _change_password, settings, p, req.current_password,
                                 req.new_password)
        if isinstance(outcome, Throttled):
            wait = outcome.retry_after
            return JSONResponse(status_code=429, headers={"Retry-After": str(wait)},
                                content={"detail": [{"field": "current_password", "message":
                                         throttle.too_many(wait, "password checks")}]})
        if outcome is None:
            return JSONResponse(status_code=422, content={"detail": [{
                "field": "current_password", "message": "is not your current password"}]})
        return {"name": p.name, "sessions_ended": outcome}

    @r.post("/api/users/{name}/end-sessions", tags=["meta"], responses=_responses(401, 403, 404),
            summary="Admin: end every browser session of a user (their API tokens keep working)")
    def end_sessions(name: str = Path(..., max_length=64)) -> Any:
        from storage import users

        if not current_user(settings).is_admin:
            raise Forbidden("only admins end other users' sessions")
        with db_sessions(settings)() as s:
            try:
                n = users.end_sessions(session=s, name=name)
            except LookupError:
                return JSONResponse(status_code=404, content={"detail": f"user: no user called {name!r}"})
        return {"name": name, "sessions_ended": n}


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    from app.api import responses

    return responses(*codes)  # imported late: app.api's ERRORS are built after this module


def _change_password(settings: Any, p: Any, current: str, new: str) -> int | None:
    """Sessions ended (all of the user's but the caller's own), or None: wrong current password."""
    from storage import users

    with db_sessions(settings)() as s:
        if users.authenticate(session=s, name=p.name, password=current) is None:
            return None
        keep = p.token_id if p.via == "session" else None
        _, ended = users.set_password(session=s, name=p.name, password=new, keep_session_id=keep)
        return ended


class PasswordChange(BaseModel):
    current_password: str = Field(..., min_length=1, max_length=1024)
    new_password: str = Field(..., min_length=8, max_length=1024,
                              description="at least 8 characters")


class ShareRequest(BaseModel):
    action: Literal["new", "off", "on"] = Field(
        ..., description="new: a new token (the old link stops working); off: no link; on: link again")


class EstimateRequest(BaseModel):
    kind: JobKind = Field(..., description="the job kind")
    spec: dict[str, Any] = Field(default_factory=dict)


def _sign_in(settings: Any, name: str, password: str) -> str | None:
    """A new session secret for a valid name + password (or name + one of their API tokens)."""
    from storage import users

    with db_sessions(settings)() as s:
        parent: int | None = None
        user = users.authenticate(session=s, name=name, password=password)
        if user is None and password.startswith("fl_"):
            found = users.token_and_user(session=s, secret=password, kind="api")
            if found is not None and found[1].name == name:
                parent, user = found[0].id, found[1]  # revoking the token ends this session
        if user is None:
            return None
        secret, _ = users.issue_token(session=s, user=user, kind="session", label="browser",
                                      ttl_s=settings.session_max_age_s, parent_id=parent)
        return secret


def login_required_response(exc: PermissionError) -> JSONResponse:
    code = 403 if isinstance(exc, Forbidden) else 401
    headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
    return JSONResponse(status_code=code, content={"detail": str(exc)}, headers=headers)
