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

Modules: ``principal`` (the caller and what it may see), ``guard`` (credentials, the same-site
rule, the middleware, the open-bind refusal), ``gradio_users`` (UI events run as the signed-in user). The
sign-in pages and account routes are `app/accounts.py` (they call services; services call auth).
"""

from app.auth.gradio_users import bind_gradio_users, gradio_user, user_header_html
from app.auth.guard import (
    PUBLIC_EXACT,
    PUBLIC_PREFIXES,
    SAFE_METHODS,
    SESSION_COOKIE,
    AccessGuard,
    bearer,
    check_bind,
    cross_site_reason,
    is_loopback,
    own_origins,
    resolve,
)
from app.auth.principal import (
    Forbidden,
    Principal,
    Unauthorized,
    acting_as,
    can_read_result,
    can_see,
    current_user,
    local_principal,
    optional_user,
    owner_filter,
    principal,
    token_principal,
)

__all__ = [
    "PUBLIC_EXACT",
    "PUBLIC_PREFIXES",
    "SAFE_METHODS",
    "SESSION_COOKIE",
    "AccessGuard",
    "Forbidden",
    "Principal",
    "Unauthorized",
    "acting_as",
    "bearer",
    "bind_gradio_users",
    "can_read_result",
    "can_see",
    "check_bind",
    "cross_site_reason",
    "current_user",
    "gradio_user",
    "is_loopback",
    "local_principal",
    "optional_user",
    "own_origins",
    "owner_filter",
    "principal",
    "resolve",
    "token_principal",
    "user_header_html",
]
