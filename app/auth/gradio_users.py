"""Gradio: the signed-in user's header, Gradio's auth_dependency, and every UI event run as
the user of its browser session (Gradio events run in its queue, not in the request's task)."""

from __future__ import annotations

import contextlib
import html
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request

from app.auth.guard import resolve
from app.auth.principal import Principal, acting_as, current_user, db_sessions, principal


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

        with db_sessions(settings)() as s:
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
