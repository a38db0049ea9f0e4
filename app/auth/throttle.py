"""Throttling of sign-in and of bad tokens, per account and per client address.

Failures are counted with the `limits` library's fixed-window strategy over stacked windows
(SIGNIN_THROTTLE, default "5/minute;10/10 minutes;20/hour;50/day"): past 5 failures in a minute
the caller waits for the minute to end, past 10 in ten minutes for those ten minutes, and so on,
so the delay grows with the attack. A throttled attempt is refused with 429 + Retry-After
*before* any password is hashed. The counters live where every web process sees them: in Redis
(`limits`' own Redis storage) when REDIS_URL is set, else in the database (`SQLStorage` below, a
`limits` storage backend on the `rate_limits` table, one atomic upsert per hit).

Keys: ("signin-user", sha256 of the lower-cased name) and ("signin-ip", address) for the sign-in
form and the password change; ("token-ip", address) for bearer tokens and session cookies that
are not valid (TOKEN_THROTTLE). A successful sign-in clears its account's counters (never the
address's: a valid account must not reset an attacker's address).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from limits import RateLimitItem, parse_many
from limits.storage import Storage, storage_from_string
from limits.strategies import FixedWindowRateLimiter
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger("fisherlens.web")

Key = tuple[str, str]  # (what, who): ("signin-user", "<sha256>"), ("signin-ip", "10.0.0.7")


class SQLStorage(Storage):
    """A `limits` storage on the `rate_limits` table (migration 0006): `count` hits of `key` in
    the window that ends at `expires_at` (epoch seconds). incr is one upsert (PostgreSQL and
    SQLite both have INSERT ... ON CONFLICT ... RETURNING), so concurrent hits never lose one."""

    STORAGE_SCHEME = ["fisherlens+sql"]

    _INCR = text(
        "INSERT INTO rate_limits (key, count, expires_at) VALUES (:key, :amount, :until) "
        "ON CONFLICT (key) DO UPDATE SET "
        "count = CASE WHEN rate_limits.expires_at <= :now THEN :amount "
        "ELSE rate_limits.count + :amount END, "
        "expires_at = CASE WHEN rate_limits.expires_at <= :now THEN :until "
        "ELSE rate_limits.expires_at END "
        "RETURNING count"
    )

    def __init__(self, uri: str | None = None, wrap_exceptions: bool = False, **options: Any):
        super().__init__(uri, wrap_exceptions=wrap_exceptions)
        from storage.db import migrated_session_factory

        self.db_url = str(options.get("db_url") or uri)
        self._sessions = migrated_session_factory(self.db_url)

    @property
    def base_exceptions(self) -> type[Exception] | tuple[type[Exception], ...]:
        return SQLAlchemyError

    def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        now = time.time()
        with self._sessions() as s:
            n = s.execute(self._INCR, {"key": key[:255], "amount": amount, "now": now,
                                       "until": now + expiry}).scalar_one()
            if random.random() < 0.01:  # noqa: S311 - housekeeping, not security
                s.execute(text("DELETE FROM rate_limits WHERE expires_at < :t"), {"t": now - 60})
            s.commit()
        return int(n)

    def _row(self, key: str) -> tuple[int, float] | None:
        with self._sessions() as s:
            row = s.execute(text("SELECT count, expires_at FROM rate_limits WHERE key = :key"),
                            {"key": key[:255]}).first()
        if row is None or row[1] <= time.time():
            return None
        return int(row[0]), float(row[1])

    def get(self, key: str) -> int:
        row = self._row(key)
        return row[0] if row else 0

    def get_expiry(self, key: str) -> float:
        row = self._row(key)
        return row[1] if row else time.time()

    def check(self) -> bool:
        try:
            with self._sessions() as s:
                s.execute(text("SELECT 1"))
            return True
        except SQLAlchemyError:
            return False

    def reset(self) -> int | None:
        with self._sessions() as s:
            n = s.execute(text("DELETE FROM rate_limits")).rowcount  # type: ignore[attr-defined]
            s.commit()
        return int(n or 0)

    def clear(self, key: str) -> None:
        with self._sessions() as s:
            s.execute(text("DELETE FROM rate_limits WHERE key = :key"), {"key": key[:255]})
            s.commit()


def account_key(name: str) -> Key:
    """The per-account key: a digest, so an over-long or odd name is a short fixed key."""
    return ("signin-user", hashlib.sha256((name or "").strip().lower().encode()).hexdigest()[:32])


def address_key(what: str, address: str | None) -> Key:
    return (what, (address or "unknown")[:64])


class Throttle:
    """Stacked fixed windows (see module doc) over one storage, for one kind of attempt."""

    def __init__(self, storage: Storage, tiers: str):
        self.limiter = FixedWindowRateLimiter(storage)
        self.tiers: list[RateLimitItem] = list(parse_many(tiers)) if tiers.strip() else []

    def _each_window(self, keys: list[Key], act: Callable[[RateLimitItem, str, str], Any],
                     unavailable: str) -> bool:
        """act(window, what, who) for every key and window. A storage that cannot be reached
        (Redis or the database away) stops it: logged with `unavailable`, and False."""
        try:
            for what, who in keys:
                for tier in self.tiers:
                    act(tier, what, who)
        except Exception:  # noqa: BLE001 - Redis or the database away: do not throttle
            log.warning("throttle storage unavailable; %s", unavailable, exc_info=True)
            return False
        return True

    def retry_after(self, keys: list[Key]) -> int | None:
        """Seconds the caller must wait (some window of some key is used up), else None.
        A storage that cannot be reached throttles nothing (logged): the credential check
        still runs; throttling only guards its cost."""
        waits = [0.0]

        def check(tier: RateLimitItem, what: str, who: str) -> None:
            if not self.limiter.test(tier, what, who):
                reset = self.limiter.get_window_stats(tier, what, who).reset_time
                waits.append(reset - time.time())

        if not self._each_window(keys, check, "not throttling"):
            return None
        wait = max(waits)
        return max(1, math.ceil(wait)) if wait > 0 else None

    def fail(self, keys: list[Key]) -> None:
        """Count one failed attempt against every key and window."""
        self._each_window(keys, self.limiter.hit, "failure not counted")

    def clear(self, keys: list[Key]) -> None:
        self._each_window(keys, self.limiter.clear, "not cleared")


_lock = threading.Lock()
_storages: dict[tuple[str | None, str], Storage] = {}


def _storage(settings: Any) -> Storage:
    """Redis (limits' own storage) when REDIS_URL is set, else the database; one per process."""
    key = (settings.redis_url, settings.db_url)
    with _lock:
        if key not in _storages:
            if settings.redis_url:
                redis_storage = storage_from_string(
                    settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
                assert isinstance(redis_storage, Storage)  # a redis:// URL: the sync storage
                _storages[key] = redis_storage
            else:
                _storages[key] = SQLStorage(settings.db_url)
        return _storages[key]


def signin_throttle(settings: Any) -> Throttle:
    """Sign-in and password-change failures (SIGNIN_THROTTLE)."""
    return Throttle(_storage(settings), settings.signin_throttle)


def token_throttle(settings: Any) -> Throttle:
    """Bad bearer tokens and session cookies (TOKEN_THROTTLE), per client address."""
    return Throttle(_storage(settings), settings.token_throttle)


def client_address(scope: Any) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def too_many(retry_after: int, what: str) -> str:
    return f"too many failed {what}; try again in {retry_after} s"
