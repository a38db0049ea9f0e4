"""The guard every HTTP request passes (see the package doc): body limit, same-site rule,
DNS-rebinding check in the embedded mode, sign-in; and the refusal of an open bind."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import quote, urlsplit

from app.auth.principal import Principal, acting_as, cached_token_principal, token_principal

SESSION_COOKIE = "fl_session"
DB_DOWN = "the database cannot be reached right now; try again in a minute"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# Reachable without signing in when AUTH_REQUIRED (share links are capabilities).
PUBLIC_PREFIXES = ("/r/", "/api/results/", "/fisherlens-static/", "/share-static/", "/login")
PUBLIC_EXACT = ("/api/health", "/favicon.ico", "/logout", "/api/docs", "/api/openapi.json")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


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


def resolve_cached(settings: Any, scope: Scope) -> tuple[Principal, str] | None:
    """resolve() answered from the web process's token cache (no thread, no database), or None
    when it cannot say (no credential, or one not verified in the last seconds)."""
    tok = bearer(scope)
    if tok is not None:
        p = cached_token_principal(settings, tok)
        return (p, "token") if p else None
    sess = _cookie(scope, SESSION_COOKIE)
    if sess:
        p = cached_token_principal(settings, sess, kind="session")
        return (p, "session") if p else None
    return None


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


def _host_ok(settings: Any, scope: Scope) -> bool:
    """Embedded mode, against DNS rebinding (another site's name resolved to 127.0.0.1 is
    same-origin to a browser): every request must address this server by a loopback name,
    PUBLIC_URL's host or one of ALLOWED_HOSTS. The CLI and scripts use the loopback address."""
    host = (_header(scope, b"host") or "").strip().lower()
    if not host:
        return True  # HTTP/1.0 without Host: no browser sends that
    try:
        name = urlsplit(f"//{host}").hostname or ""
    except ValueError:
        return False
    allowed = {(urlsplit(settings.public_url).hostname or "").lower()}
    allowed |= {h.strip().lower() for h in settings.allowed_hosts.split(",") if h.strip()}
    return is_loopback(name) or name in allowed


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

        if await self._refuse_early(scope, send):
            return
        p: Principal | None = None
        how: str | None = None
        if self.settings.auth_required and (hit := resolve_cached(self.settings, scope)):
            p, how = hit
        elif self.settings.auth_required:
            try:
                p, how = await anyio.to_thread.run_sync(resolve, self.settings, scope)
            except Exception as exc:
                from storage.db import is_outage

                if not is_outage(exc):
                    raise
                if not _is_public(scope.get("path") or "/"):  # health and share links go on
                    await _send_json(send, 503, {"detail": DB_DOWN}, [(b"retry-after", b"30")])
                    return
            if p is None and how is not None and await self._throttled(scope, send):
                return
        if await self._refuse_caller(scope, send, p, how):
            return
        if scope["type"] != "http":
            with acting_as(p):
                await self.app(scope, receive, send)
            return
        body = _BodyLimit(receive, send, self.settings.max_body_bytes)
        with acting_as(p):
            await self.app(scope, body.receive, body.send)

    async def _throttled(self, scope: Scope, send: Send) -> bool:
        """A bad bearer token / session cookie (on a path that needs a credential): counted
        against the client's address (one atomic increment per window, so concurrent bad tokens
        cannot all pass a look taken before they counted); 429 + Retry-After when that used up
        TOKEN_THROTTLE, else the caller answers 401. True when answered. Valid credentials cost
        no throttle look-up (a token is one indexed look-up of its sha256: nothing to reserve)."""
        import anyio.to_thread

        from app.auth import throttle

        if _is_public(scope.get("path") or "/"):
            return False
        limits = throttle.token_throttle(self.settings)
        keys = [throttle.address_key("token-ip", throttle.client_address(scope))]
        wait = await anyio.to_thread.run_sync(limits.fail, keys)  # counted atomically
        if wait is None:
            return False
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 4429})
            return True
        await _send_json(send, 429, {"detail": throttle.too_many(wait, "credentials from your "
                                                                 "address")},
                         [(b"retry-after", str(wait).encode())])
        return True

    async def _refuse_early(self, scope: Scope, send: Send) -> bool:
        """Answer 413 for a declared body over the limit, 403 for a browser that reached the
        embedded server under another name; True when answered."""
        settings = self.settings
        if scope["type"] == "http":
            limit = settings.max_body_bytes
            length = _header(scope, b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                await _send_json(send, 413, {"detail": f"request body is {int(length)} bytes; "
                                             f"the limit is {limit} bytes", "limit": limit,
                                             "value": int(length)},
                                 [(b"connection", b"close")])
                return True
        if not (settings.auth_required or settings.allow_open_bind) and not _host_ok(settings, scope):
            await _send_json(send, 403, {"detail": "this single-user server answers only at "
                                         "127.0.0.1 / localhost, PUBLIC_URL's host or ALLOWED_HOSTS; "
                                         "this request addressed it under another name (DNS "
                                         "rebinding?)"})
            return True
        return False

    async def _refuse_caller(
        self, scope: Scope, send: Send, p: Principal | None, how: str | None
    ) -> bool:
        """Answer 403 for a cross-site change, and (AUTH_REQUIRED) 303 to /login for a page,
        401 otherwise for nobody signed in on a non-public path; True when answered."""
        path = scope.get("path") or "/"
        method = scope.get("method", "GET")
        if scope["type"] == "http" and method not in SAFE_METHODS:
            why = cross_site_reason(self.settings, scope, cookie_auth=how == "session")
            if why:
                await _send_json(send, 403, {"detail": why})
                return True
        if not self.settings.auth_required or p is not None or _is_public(path):
            return False
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 4401})
            return True
        accept = _header(scope, b"accept") or ""
        if method == "GET" and "text/html" in accept and not path.startswith("/api/"):
            target = "/login?next=" + quote(path + ("?" + scope["query_string"].decode("latin-1")
                                                    if scope.get("query_string") else ""), safe="")
            await send({"type": "http.response.start", "status": 303,
                        "headers": [(b"location", target.encode()), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return True
        detail = how or "sign in first: send 'Authorization: Bearer <token>' (see `fisherlens user token`) or sign in at /login"
        await _send_json(send, 401, {"detail": detail}, [(b"www-authenticate", b"Bearer")])
        return True


class _BodyLimit:
    """receive/send for the app that stop a body of unknown length at `limit` bytes: past it,
    answer 413 now and tell the app the client left (the body is never read beyond the limit,
    whoever reads it); whatever the app answers afterwards is dropped."""

    def __init__(self, receive: Receive, send: Send, limit: int):
        self._receive, self._send, self.limit = receive, send, limit
        self.seen = 0
        self.started = False
        self.refused = False

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        msg = await self._receive()
        if msg["type"] == "http.request":
            self.seen += len(msg.get("body", b""))
            if self.seen > self.limit:
                self.refused = True
                if not self.started:
                    self.started = True
                    await _send_json(self._send, 413, {"detail": f"request body is over the limit "
                                                       f"of {self.limit} bytes", "limit": self.limit},
                                     [(b"connection", b"close")])
                return {"type": "http.disconnect"}
        return msg

    async def send(self, msg: Message) -> None:
        if self.refused:
            return  # the 413 has been sent; whatever the app answers is dropped
        if msg["type"] == "http.response.start":
            self.started = True
        await self._send(msg)


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
