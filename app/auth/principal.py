"""Who is calling: the Principal of a request or UI event, and what it may see."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


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
    max_job_cost: float | None  # the effective per-job cost ceiling (app/limits.job_ceiling)
    via: str = "local"  # local | token | session
    max_job_seconds: float | None = None  # the run-time limit max_job_cost comes from, if any
    token_id: int | None = None  # the api_tokens row of the token or session used

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "is_admin": self.is_admin,
                "max_active_jobs": self.max_active_jobs, "max_job_cost": self.max_job_cost,
                "max_job_seconds": self.max_job_seconds, "via": self.via}


_current: ContextVar[Principal | None] = ContextVar("fisherlens_user", default=None)


def principal(user: Any, settings: Any, via: str, token_id: int | None = None) -> Principal:
    """A users row -> Principal with its effective limits (per-user value, else the role's)."""
    from app.ceiling import job_ceiling

    admin = bool(user.is_admin)
    active = user.max_active_jobs if user.max_active_jobs is not None else (
        settings.max_active_jobs_admin if admin else settings.max_active_jobs)
    cost, seconds = job_ceiling(settings, is_admin=admin, max_job_cost=user.max_job_cost,
                                max_job_seconds=getattr(user, "max_job_seconds", None))
    return Principal(user.id, user.name, admin, active, cost, via, seconds, token_id)


def db_sessions(settings: Any) -> Any:
    from storage.db import migrated_session_factory

    return migrated_session_factory(settings.db_url)


def local_principal(settings: Any) -> Principal:
    from storage import users

    with db_sessions(settings)() as s:
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

    with db_sessions(settings)() as s:
        user = users.get_user(session=s, name=owner)
    return user.id if user is not None else -1  # unknown user: an empty list


def token_principal(settings: Any, secret: str, kind: str | None = None) -> Principal | None:
    """The caller a live token (kind None: an API token or a session; "session": a browser
    session only) belongs to, else None. In the web process a verified token is remembered for
    a few seconds (app/auth/token_cache.py: dropped on any revoke, password change, ...)."""
    from app.auth import token_cache
    from storage import users

    cache = token_cache.cache_for(settings)
    if cache is not None:
        hit = cache.get(secret, kind)
        if hit is not None:
            return hit
        generation = cache.generation  # read before the look-up: a change after it wins
    with db_sessions(settings)() as s:
        found = users.token_and_user(session=s, secret=secret, kind=kind)
        if found is None:
            return None
        tok, user = found
        p = principal(user, settings, "session" if kind == "session" else "token", tok.id)
    if cache is not None:
        cache.put(secret, kind, p, generation, tok.expires_at)
    return p


def cached_token_principal(settings: Any, secret: str, kind: str | None = None) -> Principal | None:
    """token_principal from the web process's cache only (no database): None on a miss."""
    from app.auth import token_cache

    cache = token_cache.cache_for(settings)
    return cache.get(secret, kind) if cache is not None else None
