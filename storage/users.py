"""Users, API tokens and browser sessions: repository functions (session passed in).

Passwords are hashed with argon2id through pwdlib (a maintained library; nothing hand-rolled).
Tokens are 256-bit random secrets (`fl_` + 43 URL-safe characters); only their sha256 is stored,
so a leaked database does not leak usable tokens. A token's `prefix` (its first 10 characters)
names it in listings and can be given to `revoke_token`.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable
from datetime import timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from storage.models import ApiToken, Job, User, utcnow

LOCAL_USER = "local"  # the embedded single-user mode's owner (created by migration 0003)
TOKEN_PREFIX_LEN = 10
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
ACTIVE = ("queued", "running")
# PostgreSQL NOTIFY channel: a token, session or user changed (revoked, password, limits,
# disabled). Web processes cache verified tokens (app/auth/token_cache.py) and drop them on it.
CREDENTIALS_CHANNEL = "fisherlens_credentials"
_on_change: list[Callable[[], None]] = []  # this process's caches, dropped after each commit


def on_credentials_change(fn: Callable[[], None]) -> None:
    """Call `fn` after every change of a token, session or user committed by this process."""
    if fn not in _on_change:
        _on_change.append(fn)


def commit_credentials(session: Session) -> None:
    """Commit a change of tokens, sessions or users so that no cache keeps the old state: on
    PostgreSQL a NOTIFY in the same transaction (delivered to every listening process when it
    commits), and this process's caches are dropped once it has committed."""
    bind = session.get_bind()
    if bind.dialect.name == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CREDENTIALS_CHANNEL})
    try:
        session.commit()
    finally:
        for fn in list(_on_change):
            fn()


@lru_cache(maxsize=1)
def _hasher() -> Any:
    from pwdlib import PasswordHash

    return PasswordHash.recommended()  # argon2id


def hash_password(password: str) -> str:
    return str(_hasher().hash(password))


def verify_password(password: str, hashed: str | None) -> bool:
    if not hashed:
        return False
    try:
        return bool(_hasher().verify(password, hashed))
    except Exception:  # noqa: BLE001 - a malformed stored hash is a failed login, not a 500
        return False


def token_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def check_name(name: str) -> str:
    """The user name, or ValueError naming the accepted form."""
    name = (name or "").strip()
    if not NAME_RE.match(name):
        raise ValueError(
            f"NAME: got {name!r}; accepted: 1-64 characters, letters, digits and _ . @ -, "
            "starting with a letter or digit"
        )
    return name


# -- users ------------------------------------------------------------------------------------
def create_user(
    *, session: Session, name: str, password: str | None = None, is_admin: bool = False
) -> User:
    """A new user; ValueError if the name is malformed or taken."""
    name = check_name(name)
    if get_user(session=session, name=name) is not None:
        raise ValueError(f"NAME: a user called {name!r} already exists")
    taken = session.scalar(select(User).where(func.lower(User.name) == name.lower()))
    if taken is not None:  # 'ADMIN' beside 'admin' reads as the same person
        raise ValueError(f"NAME: {name!r} differs from the existing user {taken.name!r} only in "
                         "case; user names are unique whatever their case")
    user = User(
        name=name,
        password_hash=hash_password(password) if password else None,
        is_admin=is_admin,
        disabled=False,
        created_at=utcnow(),
    )
    session.add(user)
    session.commit()
    return user


def get_user(*, session: Session, name: str) -> User | None:
    return session.scalar(select(User).where(User.name == name))


def get_user_by_id(*, session: Session, user_id: int) -> User | None:
    return session.get(User, int(user_id), populate_existing=True)


def local_user(*, session: Session) -> User:
    """The embedded mode's user (admin, no password); created if a database lacks it."""
    user = get_user(session=session, name=LOCAL_USER)
    if user is None:
        user = User(name=LOCAL_USER, is_admin=True, disabled=False, created_at=utcnow())
        session.add(user)
        session.commit()
    return user


def list_users(*, session: Session) -> list[User]:
    return list(session.scalars(select(User).order_by(User.id)))


def set_password(
    *, session: Session, name: str, password: str, keep_session_id: int | None = None
) -> tuple[User, int]:
    """(user, sessions ended): a new password ends every browser session of the user (a session
    outlives no password), except `keep_session_id`, the one that made the change, if given."""
    user = _must_user(session, name)
    user.password_hash = hash_password(password)
    ended = _revoke_sessions(session, user.id, keep=keep_session_id)
    commit_credentials(session)
    return user, ended


def end_sessions(*, session: Session, name: str) -> int:
    """End every browser session of a user (an admin's action); returns how many were live.
    Their API tokens keep working (revoke those with revoke_token)."""
    user = _must_user(session, name)
    ended = _revoke_sessions(session, user.id)
    commit_credentials(session)
    return ended


def _revoke_sessions(session: Session, user_id: int, keep: int | None = None) -> int:
    q = update(ApiToken).where(
        ApiToken.user_id == user_id, ApiToken.kind == "session", ApiToken.revoked_at.is_(None)
    )
    if keep is not None:
        q = q.where(ApiToken.id != keep)
    res = session.execute(q.values(revoked_at=utcnow()).execution_options(synchronize_session=False))
    return int(res.rowcount or 0)  # type: ignore[attr-defined]


def set_limits(
    *,
    session: Session,
    name: str,
    max_active_jobs: int | None,
    max_job_cost: float | None,
    max_job_seconds: float | None = None,
) -> User:
    user = _must_user(session, name)
    user.max_active_jobs = max_active_jobs
    user.max_job_cost = max_job_cost
    user.max_job_seconds = max_job_seconds
    commit_credentials(session)  # a cached caller carries its limits
    return user


def set_disabled(*, session: Session, name: str, disabled: bool) -> User:
    """A disabled user cannot sign in and none of their tokens or sessions work."""
    user = _must_user(session, name)
    user.disabled = disabled
    commit_credentials(session)
    return user


def authenticate(*, session: Session, name: str, password: str) -> User | None:
    """The user if the password matches (and the user is enabled), else None."""
    user = get_user(session=session, name=(name or "").strip())
    if user is None or user.disabled:
        _hasher().hash(password or "x")  # same work either way: no user-name oracle by timing
        return None
    return user if verify_password(password, user.password_hash) else None


def _must_user(session: Session, name: str) -> User:
    user = get_user(session=session, name=name)
    if user is None:
        raise LookupError(f"NAME: no user called {name!r}")
    return user


# -- tokens and sessions ----------------------------------------------------------------------
def issue_token(
    *,
    session: Session,
    user: User,
    kind: str = "api",
    label: str = "",
    ttl_s: float | None = None,
    parent_id: int | None = None,
) -> tuple[str, ApiToken]:
    """(secret, row): the secret is shown once and never stored. `parent_id`: the API token a
    session was opened with (revoking that token ends the session)."""
    secret = "fl_" + secrets.token_urlsafe(32)
    row = ApiToken(
        user_id=user.id,
        token_hash=token_hash(secret),
        prefix=secret[:TOKEN_PREFIX_LEN],
        kind=kind,
        label=label[:200],
        created_at=utcnow(),
        expires_at=utcnow() + timedelta(seconds=ttl_s) if ttl_s else None,
        parent_id=parent_id,
    )
    session.add(row)
    session.commit()
    return secret, row


def user_for_token(
    *, session: Session, secret: str, kind: str | None = None, touch: bool = True
) -> User | None:
    """The enabled user a live (not revoked, not expired) token belongs to, else None."""
    found = token_and_user(session=session, secret=secret, kind=kind, touch=touch)
    return found[1] if found else None


def token_and_user(
    *, session: Session, secret: str, kind: str | None = None, touch: bool = True
) -> tuple[ApiToken, User] | None:
    """(token row, user) of a live token of an enabled user, else None."""
    if not secret or len(secret) > 200:
        return None
    q = select(ApiToken, User).join(User, User.id == ApiToken.user_id).where(
        ApiToken.token_hash == token_hash(secret), ApiToken.revoked_at.is_(None)
    )
    if kind is not None:
        q = q.where(ApiToken.kind == kind)
    row = session.execute(q).first()
    if row is None:
        return None
    tok, user = row
    now = utcnow()
    if user.disabled or (tok.expires_at is not None and tok.expires_at <= now):
        return None
    if touch and (tok.last_used_at is None or now - tok.last_used_at > timedelta(minutes=1)):
        tok.last_used_at = now  # at most once a minute: polling must not write on every request
        session.commit()
    return tok, user


def revoke_secret(*, session: Session, secret: str) -> bool:
    """Revoke the token or session with this secret (sign-out). True if one was live."""
    res = session.execute(
        update(ApiToken)
        .where(ApiToken.token_hash == token_hash(secret), ApiToken.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    commit_credentials(session)
    return bool(res.rowcount)  # type: ignore[attr-defined]


def revoke_token(*, session: Session, ref: str) -> ApiToken:
    """Revoke the API token whose id (a number) or prefix (its first characters, at least 6)
    is `ref`, and the browser sessions signed in with it. LookupError if none or several
    match."""
    ref = (ref or "").strip()
    q = select(ApiToken).where(ApiToken.revoked_at.is_(None))
    if ref.isdigit():
        q = q.where(ApiToken.id == int(ref))
    elif len(ref) > TOKEN_PREFIX_LEN:  # the whole token
        q = q.where(ApiToken.token_hash == token_hash(ref))
    elif len(ref) >= 6:
        q = q.where(ApiToken.prefix.startswith(ref, autoescape=True))
    else:
        raise LookupError(
            f"TOKEN: got {ref!r}; give a token id or at least the first 6 characters of the token"
        )
    rows = list(session.scalars(q))
    if not rows:
        raise LookupError(f"TOKEN: no live token matches {ref!r} (see `fisherlens user list`)")
    if len(rows) > 1:
        raise LookupError(f"TOKEN: {len(rows)} tokens match {ref!r}; give more characters or the id")
    now = utcnow()
    rows[0].revoked_at = now
    session.execute(
        update(ApiToken)
        .where(ApiToken.parent_id == rows[0].id, ApiToken.revoked_at.is_(None))
        .values(revoked_at=now)
        .execution_options(synchronize_session=False)
    )
    commit_credentials(session)
    return rows[0]


def list_tokens(*, session: Session, user: User | None = None, kind: str = "api") -> list[ApiToken]:
    q = select(ApiToken).where(ApiToken.kind == kind, ApiToken.revoked_at.is_(None))
    if user is not None:
        q = q.where(ApiToken.user_id == user.id)
    return list(session.scalars(q.order_by(ApiToken.id)))


# -- ownership --------------------------------------------------------------------------------
def active_jobs(*, session: Session, owner_id: int) -> int:
    """Queued + running top-level jobs of a user (what the per-user queue limit counts)."""
    return int(
        session.scalar(
            select(func.count(Job.id)).where(
                Job.owner_id == owner_id, Job.status.in_(ACTIVE), Job.parent_id.is_(None)
            )
        )
        or 0
    )
