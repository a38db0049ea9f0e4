"""The session factory (schema migrated once per process) and the public form of a job."""

from __future__ import annotations

import contextvars
import re
from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from storage.db import migrated_session_factory


def sessions(settings: Any) -> sessionmaker[Session]:
    """The session factory for settings.db_url, migrating the schema once per process."""
    return migrated_session_factory(settings.db_url)


# The address the current web request reached this server by (set per request by app/web.py),
# for share links when PUBLIC_URL is not set: a server started with --host 0.0.0.0 hands out
# links that work from the machine that asked, not 127.0.0.1.
REQUEST_BASE: contextvars.ContextVar[str | None] = contextvars.ContextVar("fisherlens_request_base", default=None)


def base_url(headers: Mapping[str, str], scheme: str = "http") -> str | None:
    """'http://host:port' from a request's Host (and X-Forwarded-Proto) header; None without one."""
    host = (headers.get("x-forwarded-host") or headers.get("host") or "").split(",")[0].strip()
    if not host or any(c in host for c in "/\\ @"):
        return None
    proto = (headers.get("x-forwarded-proto") or scheme or "http").split(",")[0].strip().lower()
    return f"{proto if proto in ('http', 'https') else 'http'}://{host}"


def share_url(settings: Any, token: str, base: str | None = None) -> str:
    """The share link of `token`: under PUBLIC_URL when it is set, else under the address the
    request reached us by (`base`, or the current web request's), else the default PUBLIC_URL."""
    root = settings.public_url
    if "public_url" not in settings.model_fields_set:
        root = base or REQUEST_BASE.get() or root
    return f"{root.rstrip('/')}/r/{token}"


def public(settings: Any, job_dict: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A job dict: `message` is one line with no server path. `error` (the traceback) is for
    operators (the CLI, tests, the worker log): web responses drop it (without_error)."""
    out = dict(job_dict)
    out["message"] = public_message(out.get("message"))
    out["share_url"] = share_url(settings, job_dict["share_token"])
    out.update(extra)
    return out


def without_error(data: Any) -> Any:
    """A job dict, a list of them or a result dict as the web shows it: no `error` field."""
    if isinstance(data, list):
        return [without_error(d) for d in data]
    if isinstance(data, dict):
        out = {k: v for k, v in data.items() if k != "error"}
        if isinstance(out.get("job"), dict):
            out["job"] = without_error(out["job"])
        return out
    return data


_SERVER_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.\-+@~]+){2,}/?")


def public_message(message: Any, limit: int = 500) -> str:
    """One line a user can act on: the last line of a traceback, server paths as <path>."""
    text = str(message or "").strip()
    if "Traceback (most recent call last)" in text:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        text = lines[-1] if lines else ""
    text = text.splitlines()[0] if text else ""
    text = _SERVER_PATH.sub("<path>", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
