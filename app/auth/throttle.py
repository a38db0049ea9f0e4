"""Throttling of sign-in and of bad tokens, per account and per client address.

Failures are counted with the `limits` library's fixed-window strategy over stacked windows
(SIGNIN_THROTTLE, default "5/minute;10/10 minutes;20/hour;50/day"): past 5 failures in a minute
the caller waits for the minute to end, past 10 in ten minutes for those ten minutes, and so on,
so the delay grows with the attack. Every attempt is counted *before* its password is hashed
(`Throttle.reserve`: one atomic increment per window, so concurrent guesses cannot all pass a
check made before any of them counted); one over a window is refused with 429 + Retry-After
and given back; a success gives its attempt back. The counters live where every web process sees them: in Redis
(`limits`' own Redis storage) when REDIS_URL is set, else in the database (`SQLStorage` below, a
`limits` storage backend on the `rate_limits` table, one atomic upsert per hit). While that
storage cannot be reached, each process keeps the same windows in memory: never unthrottled.

Keys: ("signin-user", sha256 of the lower-cased name) and ("signin-ip", address) for the sign-in
form and the password change; ("token-ip", address) for bearer tokens and session cookies that
are not valid (TOKEN_THROTTLE). A successful sign-in clears its account's counters (never the
address's: a valid account must not reset an attacker's address).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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


DOWN_RETRY_S = 5.0  # after the shared storage failed, the in-process windows only, this long
_down_until: dict[int, float] = {}  # id(storage) -> monotonic time to try it again


@dataclass
class Reservation:
    """Attempts reserved by `Throttle.reserve`: (storage, key, expiry) of every window hit, so
    that a success (or an attempt never made) can give them back."""

    hits: list[tuple[Storage, str, int]] = field(default_factory=list)


class Throttle:
    """Stacked fixed windows (see module doc) over one storage, for one kind of attempt.

    `reserve` counts an attempt *before* it is made: one atomic increment per key and window
    (Redis INCRBY, or the database's upsert), so N concurrent guesses see N different counts
    and at most the limit of them proceed to verify anything. When the shared storage cannot be
    reached (Redis or the database away) the same windows are kept in this process's memory
    (`limits`' MemoryStorage): throttling degrades to per-process, never to none."""

    def __init__(self, storage: Storage, tiers: str, local: Storage | None = None):
        self.storage = storage
        self.local = local or _local_storage()
        self.tiers: list[RateLimitItem] = list(parse_many(tiers)) if tiers.strip() else []

    def _apply(self, what: str, act: Callable[[Storage], Any]) -> Any:
        """act(shared storage), or act(this process's memory) when the shared one is away (for
        DOWN_RETRY_S after a failure it is not tried again: each try costs a connect timeout)."""
        if time.monotonic() >= _down_until.get(id(self.storage), 0.0):
            try:
                return act(self.storage)
            except Exception:  # noqa: BLE001 - Redis or the database away: this process's windows
                _down_until[id(self.storage)] = time.monotonic() + DOWN_RETRY_S
                log.warning("throttle storage unavailable (%s); this process's memory for %.0f s",
                            what, DOWN_RETRY_S, exc_info=True)
        return act(self.local)

    def reserve(self, keys: list[Key]) -> Reservation | int:
        """Count one attempt against every key and window, before it is made. A Reservation
        when every window still had room (the caller may verify; `release` gives the attempt
        back on success), else the seconds to wait (Retry-After): the hits just made are given
        back, so refused attempts do not push the windows further."""
        def hit_all(storage: Storage) -> Reservation | int:
            res, waits = Reservation(), []
            limiter = FixedWindowRateLimiter(storage)
            for what, who in keys:
                for tier in self.tiers:
                    key = tier.key_for(what, who)
                    res.hits.append((storage, key, tier.get_expiry()))
                    if storage.incr(key, tier.get_expiry()) > tier.amount:
                        reset = limiter.get_window_stats(tier, what, who).reset_time
                        waits.append(reset - time.time())
            if waits:
                self.release(res)
                return max(1, math.ceil(max(waits)))
            return res

        out: Reservation | int = self._apply("reserve", hit_all)
        return out

    def release(self, res: Reservation) -> None:
        """Give back the attempts of `res` (a success, or an attempt that was never made)."""
        for storage, key, expiry in res.hits:
            try:
                if storage.get(key) > 0:  # a window that ended meanwhile starts at 0, not -1
                    storage.incr(key, expiry, amount=-1)
            except Exception:  # noqa: BLE001 - away now: the window ends on its own
                log.warning("throttle storage unavailable; an attempt not given back", exc_info=True)
                return
        res.hits.clear()

    def fail(self, keys: list[Key]) -> int | None:
        """Count one failed attempt (made already: a bad bearer token, one indexed look-up of
        its sha256) against every key and window, atomically; the seconds to wait when that
        failure used up a window (the caller answers 429 instead of 401), else None."""
        res = self.reserve(keys)
        return res if isinstance(res, int) else None

    def retry_after(self, keys: list[Key]) -> int | None:
        """Seconds the caller must wait (some window of some key is used up), else None. Only a
        look: `reserve` is what gates an attempt."""
        def look(storage: Storage) -> int | None:
            limiter = FixedWindowRateLimiter(storage)
            waits = [limiter.get_window_stats(t, what, who).reset_time - time.time()
                     for what, who in keys for t in self.tiers if not limiter.test(t, what, who)]
            return max(1, math.ceil(max(waits))) if waits else None

        out: int | None = self._apply("look", look)
        return out

    def clear(self, keys: list[Key]) -> None:
        def clear(storage: Storage) -> None:
            limiter = FixedWindowRateLimiter(storage)
            for what, who in keys:
                for tier in self.tiers:
                    limiter.clear(tier, what, who)

        self._apply("clear", clear)
        with contextlib.suppress(Exception):  # and this process's own windows
            clear(self.local)


_lock = threading.Lock()
_storages: dict[tuple[str | None, str], Storage] = {}
_memory: list[Storage] = []


def _local_storage() -> Storage:
    """This process's in-memory windows (one per process): the fallback of every Throttle."""
    with _lock:
        if not _memory:
            mem = storage_from_string("memory://")
            assert isinstance(mem, Storage)
            _memory.append(mem)
        return _memory[0]


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
    """Sign-in and password-change attempts (SIGNIN_THROTTLE)."""
    return Throttle(_storage(settings), settings.signin_throttle)


def token_throttle(settings: Any) -> Throttle:
    """Bad bearer tokens and session cookies (TOKEN_THROTTLE), per client address."""
    return Throttle(_storage(settings), settings.token_throttle)


def client_address(scope: Any) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def too_many(retry_after: int, what: str) -> str:
    return f"too many failed {what}; try again in {retry_after} s"
