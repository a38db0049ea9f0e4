"""Who is calling: the two modes, sign-in, and the guard every HTTP request passes.

* Embedded default (`AUTH_REQUIRED` off, bound to loopback): single-user, no login; every call
  runs as the user `local` (an admin created by migration 0003), exactly as before accounts.
* `AUTH_REQUIRED=true`: every API call and UI page needs a signed-in user, except share links
  (`/r/<token>`, `/api/results/<token>...`), health, the login page and static assets. The REST
  API takes `Authorization: Bearer <token>`; a browser signs in on `/login` and gets an HttpOnly,
  SameSite=Strict session cookie (a random secret whose sha256 is a row in `api_tokens`, so
  signing out revokes it on the server).

`AccessGuard` (pure ASGI middleware, outermost) enforces, in order: the request body limit (413,
from Content-Length or while the body streams; a 200 MB body is never read), the cross-site rule
(a state-changing request whose Origin/Referer is another site is refused with 403 in both modes;
one authenticated by the session cookie must carry a same-site Origin or Referer), then sign-in.
In the embedded mode a browser must also address the server by a loopback name or PUBLIC_URL's
host (DNS rebinding: another site's name resolved to 127.0.0.1 is same-origin to the browser).
The caller is put in a context variable for the request; `current_user()` reads it, so services
need no extra parameter. Gradio events run in Gradio's queue, not in the request's task:
`bind_gradio_users` wraps every event function to run as the user Gradio's `auth_dependency`
named for that session.
"""

from __future__ import annotations

import contextlib
import html
import ipaddress
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any, Literal
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field

SESSION_COOKIE = "fl_session"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# Reachable without signing in when AUTH_REQUIRED (share links are capabilities).
PUBLIC_PREFIXES = ("/r/", "/api/results/", "/fisherlens-static/", "/share-static/", "/login")
PUBLIC_EXACT = ("/api/health", "/favicon.ico", "/logout", "/api/docs", "/api/openapi.json")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Unauthorized(PermissionError):
    """No signed-in user where one is required (HTTP 401)."""


class Forbidden(PermissionError):
    """Signed in, but not allowed (HTTP 403), e.g. registering a model name as a non-admin."""


@dataclass(frozen=True)
class Principal:
    """The caller, with the limits that apply to them (None: no limit)."""

    id: int
    name: str
    is_admin: bool
    max_active_jobs: int | None
    max_job_cost: float | None
    via: str = "local"  # local | token | session

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "is_admin": self.is_admin,
                "max_active_jobs": self.max_active_jobs, "max_job_cost": self.max_job_cost,
                "via": self.via}


_current: ContextVar[Principal | None] = ContextVar("fisherlens_user", default=None)


def principal(user: Any, settings: Any, via: str) -> Principal:
    """A users row -> Principal with its effective limits (per-user value, else the role's)."""
    admin = bool(user.is_admin)
    active = user.max_active_jobs if user.max_active_jobs is not None else (
        settings.max_active_jobs_admin if admin else settings.max_active_jobs)
    cost = user.max_job_cost if user.max_job_cost is not None else (
        settings.max_job_cost_admin if admin else settings.max_job_cost)
    return Principal(user.id, user.name, admin, active, cost, via)


def _sessions(settings: Any) -> Any:
    from app import services

    return services.sessions(settings)


def local_principal(settings: Any) -> Principal:
    from storage import users

    with _sessions(settings)() as s:
        return principal(users.local_user(session=s), settings, "local")


def current_user(settings: Any) -> Principal:
    """The caller of this request / UI event; the local user in the embedded mode; Unauthorized
    when AUTH_REQUIRED and nobody signed in."""
    p = _current.get()
    if p is not None:
        return p
    if not settings.auth_required:
        return local_principal(settings)
    raise Unauthorized("sign in first: send 'Authorization: Bearer <token>' or sign in at /login")


@contextlib.contextmanager
def acting_as(p: Principal | None) -> Iterator[None]:
    """Run a block as `p` (the CLI with direct database access, tests, UI events)."""
    tok = _current.set(p)
    try:
        yield
    finally:
        _current.reset(tok)


def optional_user(settings: Any) -> Principal | None:
    """current_user, or None for an anonymous caller (share links) when AUTH_REQUIRED."""
    try:
        return current_user(settings)
    except Unauthorized:
        return None


def can_see(p: Principal | None, owner_id: int | None) -> bool:
    """Owners and admins see a job; nobody else does (it answers 404 to them)."""
    return p is not None and (p.is_admin or owner_id == p.id)


def can_read_result(settings: Any, job: Any) -> bool:
    """A result is readable by its owner and admins, and by anyone holding its share link
    while the owner keeps the link on (`jobs.shared`)."""
    return bool(job.shared) or can_see(optional_user(settings), job.owner_id)


def owner_filter(settings: Any, p: Principal, owner: str | None) -> int | None:
    """The owner id a job listing is restricted to (None: everyone's). Users see their own
    jobs; admins see everyone's, or one user's with owner=NAME ('me': their own). The embedded
    mode lists every job, as before accounts."""
    if not settings.auth_required:
        return None  # one local user: every job, as before accounts
    if not p.is_admin:
        return p.id
    if owner in (None, "", "all"):
        return None
    if owner == "me" or owner == p.name:
        return p.id
    from storage import users

    with _sessions(settings)() as s:
        user = users.get_user(session=s, name=owner)
    return user.id if user is not None else -1  # unknown user: an empty list


def check_refs_owned(settings: Any, p: Principal, kind: str, spec: Any) -> None:
    """A spec may name only jobs its submitter can see (job:N of another user is 'no such
    job', the same answer as for a job that does not exist)."""
    from compute.modelref import job_ref_id, spec_job_refs
    from compute.specs import SpecError
    from storage import repo

    refs = spec_job_refs(kind, spec)
    if not refs or p.is_admin:
        return
    errors = []
    with _sessions(settings)() as s:
        for field, ref in refs:
            job = repo.get_job(session=s, job_id=job_ref_id(ref) or -1)
            if job is None or not can_see(p, job.owner_id):
                errors.append({"field": field, "message": f"job {job_ref_id(ref)} does not exist; "
                               "give the id of one of your succeeded jobs"})
    if errors:
        raise SpecError(errors)


def token_principal(settings: Any, secret: str, kind: str | None = None) -> Principal | None:
    from storage import users

    with _sessions(settings)() as s:
        user = users.user_for_token(session=s, secret=secret, kind=kind)
        if user is None:
            return None
        return principal(user, settings, "session" if kind == "session" else "token")


# ---------------------------------------------------------------- request credentials


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers") or []:
        if k == name:
            return bytes(v).decode("latin-1")
    return None


def _cookie(scope: Scope, name: str) -> str | None:
    raw = _header(scope, b"cookie")
    if not raw:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except Exception:  # noqa: BLE001 - a malformed cookie header is no credential
        return None
    morsel = jar.get(name)
    return morsel.value if morsel else None


def bearer(scope: Scope) -> str | None:
    auth = _header(scope, b"authorization") or ""
    scheme, _, value = auth.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def resolve(settings: Any, scope: Scope) -> tuple[Principal | None, str | None]:
    """(principal, how) from the request's bearer token or session cookie; (None, why) when a
    credential was sent but is not valid, (None, None) when none was sent."""
    tok = bearer(scope)
    if tok is not None:
        p = token_principal(settings, tok)
        return (p, "token") if p else (None, "the bearer token is not valid (revoked or mistyped)")
    sess = _cookie(scope, SESSION_COOKIE)
    if sess:
        p = token_principal(settings, sess, kind="session")
        return (p, "session") if p else (None, "your session has ended; sign in again")
    return None, None


# ---------------------------------------------------------------- same-site check


def _origin_of(url: str) -> str | None:
    try:
        u = urlsplit(url)
    except ValueError:
        return None
    if not u.scheme or not u.netloc:
        return None
    return f"{u.scheme.lower()}://{u.netloc.lower()}"


def own_origins(settings: Any, scope: Scope) -> set[str]:
    """This server's origins: PUBLIC_URL's and the one the request was addressed to."""
    out = set()
    pub = _origin_of(settings.public_url)
    if pub:
        out.add(pub)
    host = _header(scope, b"host")
    if host:
        scheme = scope.get("scheme") or "http"
        out.add(f"{scheme}://{host.lower()}")
        proto = _header(scope, b"x-forwarded-proto")
        if proto:
            out.add(f"{proto.split(',')[0].strip().lower()}://{host.lower()}")
    return out


def cross_site_reason(settings: Any, scope: Scope, cookie_auth: bool) -> str | None:
    """Why a state-changing request must be refused as cross-site, or None if it may pass."""
    origin = _header(scope, b"origin")
    referer = _header(scope, b"referer")
    if origin and origin != "null":
        seen = _origin_of(origin)
    elif referer:
        seen = _origin_of(referer)
    else:
        seen = None
        if origin == "null":
            return "a request from an opaque origin ('null') may not change anything"
    if seen is not None:
        if seen in own_origins(settings, scope):
            return None
        return f"cross-site request from {seen} refused (only this site may change anything)"
    if _header(scope, b"sec-fetch-site") == "cross-site":
        return "cross-site request refused"
    if cookie_auth:
        return "a request signed in by cookie must carry this site's Origin or Referer"
    return None  # no browser signals and no cookie: a CLI or script


def _browser_host_ok(settings: Any, scope: Scope) -> bool:
    """Embedded mode, against DNS rebinding: a browser (it sends Sec-Fetch-* or Origin) must
    address this server by a loopback name or PUBLIC_URL's host. Scripts and the CLI send
    neither header and are not concerned (they reach the loopback address directly)."""
    if not (_header(scope, b"sec-fetch-site") or _header(scope, b"origin")):
        return True
    host = (_header(scope, b"host") or "").strip().lower()
    try:
        name = urlsplit(f"//{host}").hostname or ""
    except ValueError:
        return False
    return is_loopback(name) or name == (urlsplit(settings.public_url).hostname or "").lower()


# ---------------------------------------------------------------- the middleware


def _is_public(path: str) -> bool:
    return path in PUBLIC_EXACT or any(path.startswith(p) for p in PUBLIC_PREFIXES)


async def _send_json(send: Send, status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class AccessGuard:
    """Body limit, cross-site refusal and sign-in for every HTTP request (see module doc)."""

    def __init__(self, app: Any, settings: Any):
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        import anyio.to_thread

        settings = self.settings
        path = scope.get("path") or "/"
        method = scope.get("method", "GET")
        if scope["type"] == "http":
            limit = settings.max_body_bytes
            length = _header(scope, b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                await _send_json(send, 413, {"detail": f"request body is {int(length)} bytes; "
                                             f"the limit is {limit} bytes", "limit": limit,
                                             "value": int(length)},
                                 [(b"connection", b"close")])
                return

        if not (settings.auth_required or settings.allow_open_bind) and not _browser_host_ok(settings, scope):
            await _send_json(send, 403, {"detail": "this single-user server answers browsers only "
                                         "at 127.0.0.1 / localhost or PUBLIC_URL's host; this page "
                                         "reached it under another name (DNS rebinding?)"})
            return

        p: Principal | None = None
        how: str | None = None
        if settings.auth_required:
            p, how = await anyio.to_thread.run_sync(resolve, settings, scope)
        if scope["type"] == "http" and method not in SAFE_METHODS:
            why = cross_site_reason(settings, scope, cookie_auth=how == "session")
            if why:
                await _send_json(send, 403, {"detail": why})
                return
        if settings.auth_required and p is None and not _is_public(path):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 4401})
                return
            accept = _header(scope, b"accept") or ""
            if method == "GET" and "text/html" in accept and not path.startswith("/api/"):
                target = "/login?next=" + quote(path + ("?" + scope["query_string"].decode("latin-1")
                                                        if scope.get("query_string") else ""), safe="")
                await send({"type": "http.response.start", "status": 303,
                            "headers": [(b"location", target.encode()), (b"content-length", b"0")]})
                await send({"type": "http.response.body", "body": b""})
                return
            detail = how or "sign in first: send 'Authorization: Bearer <token>' (see `fisherlens user token`) or sign in at /login"
            await _send_json(send, 401, {"detail": detail}, [(b"www-authenticate", b"Bearer")])
            return

        if scope["type"] != "http":
            with acting_as(p):
                await self.app(scope, receive, send)
            return

        limit = settings.max_body_bytes
        seen = 0
        started = False
        refused = False

        async def counting_receive() -> Message:
            # Past the limit: answer 413 now and tell the app the client left (a body of
            # unknown length is never read beyond the limit, whoever reads it).
            nonlocal seen, started, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    refused = True
                    if not started:
                        started = True
                        await _send_json(send, 413, {"detail": f"request body is over the limit "
                                                     f"of {limit} bytes", "limit": limit},
                                         [(b"connection", b"close")])
                    return {"type": "http.disconnect"}
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 has been sent; whatever the app answers is dropped
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        with acting_as(p):
            await self.app(scope, counting_receive, tracking_send)


# ---------------------------------------------------------------- login pages


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
    """/login, /logout and /api/me."""
    r = APIRouter()
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

            with _sessions(settings)() as s:
                users.revoke_secret(session=s, secret=secret)
        resp = RedirectResponse("/login" if settings.auth_required else "/", status_code=303)
        resp.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=secure)
        return resp

    r.add_api_route("/logout", logout, methods=["GET", "POST"], include_in_schema=False)

    @r.get("/api/me", tags=["meta"], summary="Who you are, your limits and your active jobs")
    def me() -> Any:
        from storage import users

        p = current_user(settings)
        with _sessions(settings)() as s:
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
        from compute.specs import SpecError, parse_spec

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

    return r


class ShareRequest(BaseModel):
    action: Literal["new", "off", "on"] = Field(
        ..., description="new: a new token (the old link stops working); off: no link; on: link again")


class EstimateRequest(BaseModel):
    kind: str = Field(..., max_length=32)
    spec: dict[str, Any] = Field(default_factory=dict)


def _sign_in(settings: Any, name: str, password: str) -> str | None:
    """A new session secret for a valid name + password (or name + one of their API tokens)."""
    from storage import users

    with _sessions(settings)() as s:
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


# ---------------------------------------------------------------- Gradio


def user_header_html(settings: Any) -> str:
    """Who is signed in, and a sign-out link (nothing in the embedded single-user mode)."""
    if not settings.auth_required:
        return ""
    p = current_user(settings)
    role = " (admin)" if p.is_admin else ""
    return (f"<div class='fl-user' id='fl-user-box'>signed in as <b id='fl-user-name'>"
            f"{html.escape(p.name)}</b>{role} &middot; <a href='/logout' id='fl-signout'>Sign out</a></div>")


def gradio_user(settings: Any) -> Callable[[Request], str | None]:
    """Gradio's `auth_dependency`: the user name of a request (None: Gradio answers 401)."""

    def dep(request: Request) -> str | None:
        if not settings.auth_required:
            return "local"
        p, _ = resolve(settings, request.scope)
        return p.name if p else None

    return dep


class _PrincipalCache:
    """name -> Principal for a few seconds (UI polls every 1.5 s; limits change rarely)."""

    def __init__(self, ttl_s: float = 5.0):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._rows: dict[str, tuple[float, Principal | None]] = {}

    def get(self, settings: Any, name: str) -> Principal | None:
        now = time.monotonic()
        with self._lock:
            hit = self._rows.get(name)
            if hit and now - hit[0] < self.ttl_s:
                return hit[1]
        from storage import users

        with _sessions(settings)() as s:
            user = users.get_user(session=s, name=name)
            p = principal(user, settings, "session") if user and not user.disabled else None
        with self._lock:
            self._rows[name] = (now, p)
        return p


def bind_gradio_users(demo: Any, settings: Any) -> None:
    """Make every event function of `demo` run as the user Gradio's auth_dependency named for
    the browser session (request.username). A function that already takes gr.Request keeps it."""
    import functools
    import inspect

    import gradio as gr

    cache = _PrincipalCache()

    def who(request: gr.Request | None) -> Principal | None:
        name = getattr(request, "username", None) if request is not None else None
        if not settings.auth_required:
            name = "local"
        return cache.get(settings, name) if name else None

    for block_fn in demo.fns.values():
        fn = block_fn.fn
        if fn is None or getattr(fn, "_fl_bound", False):
            continue
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
            continue  # none in this UI; left as they are rather than wrapped wrongly
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            continue
        hints = {}
        with contextlib.suppress(Exception):
            hints = inspect.get_annotations(fn, eval_str=True)
        takes_request = any(hints.get(prm.name) in (gr.Request, gr.Request | None) for prm in params)
        if takes_request:
            def wrapped_own(*args: Any, __fn: Any = fn, **kwargs: Any) -> Any:
                req = next((a for a in args if isinstance(a, gr.Request)), kwargs.get("request"))
                with acting_as(who(req)):
                    return __fn(*args, **kwargs)

            new: Any = functools.wraps(fn)(wrapped_own)
        else:
            def wrapped(request: gr.Request, *args: Any, __fn: Any = fn) -> Any:
                with acting_as(who(request)):
                    return __fn(*args)

            wrapped.__annotations__ = {"request": gr.Request}  # real class: Gradio reads it
            new = wrapped
            new.__name__ = getattr(fn, "__name__", "handler")
        new._fl_bound = True  # type: ignore[attr-defined]
        block_fn.fn = new


# ---------------------------------------------------------------- binding


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, settings: Any) -> None:
    """Refuse (SystemExit with the reason) to serve a non-loopback address without accounts,
    unless the operator set ALLOW_OPEN_BIND=true."""
    if is_loopback(host) or settings.auth_required or settings.allow_open_bind:
        return
    raise SystemExit(
        f"refusing to listen on {host!r} without accounts: anyone who can reach it could run, "
        "cancel and read every job. Set AUTH_REQUIRED=true (and add users with `fisherlens user "
        "add NAME`), or listen on 127.0.0.1, or set ALLOW_OPEN_BIND=true to serve it open anyway."
    )
