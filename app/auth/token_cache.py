"""Verified bearer tokens and session cookies, remembered for a few seconds by the web process
(issue 28, item 7: an authenticated request had cost a database session of its own, three round
trips, before its route opened a second one).

A hit costs a sha256 and a dict look-up on the event loop: no thread, no database. What keeps it
honest:
- only on PostgreSQL, and only while this process LISTENs on storage.users.CREDENTIALS_CHANNEL:
  every change of a token, a session or a user (revoke, sign-out, password change, ended
  sessions, limits, disabled) commits a NOTIFY on it (storage.users.commit_credentials), from
  any process (the CLI, another web process), and each one empties the cache. Changes committed
  by this process empty it synchronously too. While the listening connection is down (or on
  SQLite) nothing is cached: every request looks its token up as before;
- a generation counter: a look-up that raced a change (read before it, stored after) is not
  stored;
- entries live at most TOKEN_CACHE_S seconds (default 10) and never past the token's own
  expiry; a change made behind the application's back (SQL typed into psql) is seen within that.
Failed look-ups are never cached (bad tokens go to the throttle each time).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from datetime import datetime
from typing import Any

Principal = Any  # app.auth.principal.Principal (not imported: principal imports this module)

log = logging.getLogger("fisherlens.auth")
RECHECK_S = 5.0  # the listening connection proves itself alive this often


class TokenCache:
    """secret's sha256 + kind -> (Principal, monotonic deadline), for one database URL."""

    def __init__(self, db_url: str, ttl_s: float):
        self.db_url = db_url
        self.ttl_s = ttl_s
        self.entries: dict[tuple[str, str | None], tuple[Principal, float]] = {}
        self.generation = 0
        self.listening = False  # the NOTIFY connection is up: only then is anything cached
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    @staticmethod
    def key(secret: str, kind: str | None) -> tuple[str, str | None]:
        return hashlib.sha256(secret.encode("utf-8")).hexdigest(), kind

    def get(self, secret: str, kind: str | None) -> Principal | None:
        if not self.listening:
            return None
        k = self.key(secret, kind)
        with self.lock:
            hit = self.entries.get(k)
            if hit is None:
                return None
            if hit[1] <= time.monotonic():
                self.entries.pop(k, None)
                return None
            return hit[0]

    def put(self, secret: str, kind: str | None, p: Principal, generation: int,
            expires_at: datetime | None = None) -> None:
        """Remember `p` unless the credentials changed since `generation` was read."""
        deadline = time.monotonic() + self.ttl_s
        if expires_at is not None:  # never past the token's own end
            from storage.models import utcnow

            deadline = min(deadline, time.monotonic() + (expires_at - utcnow()).total_seconds())
        with self.lock:
            if self.listening and generation == self.generation and deadline > time.monotonic():
                if len(self.entries) > 10_000:  # bounded: a flood of valid tokens is no leak
                    self.entries.clear()
                self.entries[self.key(secret, kind)] = (p, deadline)

    def clear(self) -> None:
        with self.lock:
            self.generation += 1
            self.entries.clear()

    # ------------------------------------------------------------ the listening connection

    def start(self) -> None:
        self.thread = threading.Thread(target=self._listen, name="fisherlens-token-cache",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _set_listening(self, on: bool) -> None:
        with self.lock:
            self.listening = on
            self.generation += 1
            self.entries.clear()

    def _listen(self) -> None:
        import psycopg
        from sqlalchemy.engine import make_url

        from storage.users import CREDENTIALS_CHANNEL

        conninfo = make_url(self.db_url).set(drivername="postgresql").render_as_string(
            hide_password=False)
        while not self.stopped.is_set():
            try:
                with psycopg.connect(conninfo, autocommit=True, connect_timeout=10) as conn:
                    conn.execute(f"LISTEN {CREDENTIALS_CHANNEL}")
                    self._set_listening(True)  # notifications missed while down: start empty
                    while not self.stopped.is_set():
                        for _ in conn.notifies(timeout=RECHECK_S):
                            self.clear()
                        conn.execute("SELECT 1")  # a dead connection raises here
            except Exception as exc:  # noqa: BLE001 - any failure: cache nothing, try again
                if self.listening:
                    log.warning("token cache off (its database connection failed: %s)",
                                type(exc).__name__)
                self._set_listening(False)
                self.stopped.wait(2.0)
        self._set_listening(False)


_caches: dict[str, TokenCache] = {}
_lock = threading.Lock()


def clear_all() -> None:
    """Empty every cache of this process (storage.users calls it after each change it commits)."""
    for cache in list(_caches.values()):
        cache.clear()


def cache_for(settings: Any) -> TokenCache | None:
    """The started cache of settings.db_url, or None (not enabled in this process)."""
    return _caches.get(settings.db_url)


def enable(settings: Any) -> TokenCache | None:
    """Start caching verified tokens for settings.db_url in this process (the web app calls it);
    None on SQLite or with TOKEN_CACHE_S=0."""
    from sqlalchemy.engine import make_url

    from storage.users import on_credentials_change

    if settings.token_cache_s <= 0 or make_url(settings.db_url).get_backend_name() != "postgresql":
        return None
    with _lock:
        cache = _caches.get(settings.db_url)
        if cache is None or cache.stopped.is_set():
            cache = TokenCache(settings.db_url, settings.token_cache_s)
            _caches[settings.db_url] = cache
            on_credentials_change(clear_all)
            cache.start()
        return cache


def disable(settings: Any) -> None:
    """Stop the cache of settings.db_url (tests, a disposed app)."""
    disable_urls(lambda url: url == settings.db_url)


def disable_urls(match: Any) -> None:
    """Stop the caches (and close the listening connections) of every URL match(url) is true
    for: a test's throwaway database, before it is dropped."""
    with _lock:
        gone = [_caches.pop(u) for u in [u for u in _caches if match(u)]]
    for cache in gone:
        cache.stop()
        cache.clear()
