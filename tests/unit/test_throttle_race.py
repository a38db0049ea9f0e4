"""The sign-in throttle counts before it works (issue 28, item 2), against a live app (uvicorn
in a thread, real HTTP, AUTH_REQUIRED) with its counters in a real Redis, and with Redis
unreachable.

30 simultaneous wrong passwords for one account, each from its own client address (uvicorn
takes it from X-Forwarded-For), verify at most the limit (5): every attempt is reserved with an
atomic increment before its password is hashed, so the 25 others get 429 + Retry-After without
any hashing. The number of password verifications is counted by wrapping
storage.users.verify_password (the real function still runs). With Redis down the same limits
hold per process (the in-process fallback), for passwords and for bad bearer tokens."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.browser import free_port

REDIS_URL = os.environ.get("FISHERLENS_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
LIMIT = 5


class Live:
    def __init__(self, home: Path, redis_url: str | None):
        import uvicorn

        from app import services
        from app.web import create_app
        from compute.contract.settings import Settings
        from storage import users

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.settings = Settings(
            fisherlens_home=home, database_url=None, redis_url=redis_url, auth_required=True,
            public_url=self.url, signin_throttle=f"{LIMIT}/minute", token_throttle=f"{LIMIT}/minute",
            signin_backlog=64, signin_threads=2)
        self.name = f"victim{time.time_ns()}"  # fresh counters in the shared Redis
        app = create_app(self.settings)
        with services.sessions(self.settings)() as s:
            u = users.create_user(session=s, name=self.name, password="pw-right-123")
            self.token, _ = users.issue_token(session=s, user=u)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    proxy_headers=True, forwarded_allow_ips="*"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def login(self, password: str, address: str) -> tuple[int, dict[str, str]]:
        body = urllib.parse.urlencode({"name": self.name, "password": password}).encode()
        req = urllib.request.Request(f"{self.url}/login", data=body, method="POST", headers={
            "Content-Type": "application/x-www-form-urlencoded", "Origin": self.url,
            "X-Forwarded-For": address})
        return _send(req)

    def bearer(self, token: str, address: str) -> tuple[int, dict[str, str]]:
        req = urllib.request.Request(f"{self.url}/api/jobs", headers={
            "Authorization": f"Bearer {token}", "X-Forwarded-For": address})
        return _send(req)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _send(req: urllib.request.Request) -> tuple[int, dict[str, str]]:
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=60) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


@pytest.fixture
def verifications(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per password verification the app makes (the real argon2 check still runs)."""
    from storage import users

    real, calls, lock = users.verify_password, [], threading.Lock()

    def counted(password: str, hashed: str) -> bool:
        with lock:
            calls.append(1)
        return bool(real(password, hashed))

    monkeypatch.setattr(users, "verify_password", counted)
    return calls


def _redis_up() -> None:
    try:
        import redis

        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001
        from tests.conftest import require_service

        require_service(f"Redis not reachable at {REDIS_URL} ({type(exc).__name__})")


def _dead_redis_url() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis), "redis-down"])
def live(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Live]:
    from app.auth import throttle

    if request.param == "redis":
        _redis_up()
    throttle._down_until.clear()
    throttle._memory.clear()  # this process's fallback windows start empty
    app = Live(tmp_path, REDIS_URL if request.param == "redis" else _dead_redis_url())
    try:
        yield app
    finally:
        app.stop()


def _burst(n: int, fn: Any) -> list[tuple[int, dict[str, str]]]:
    barrier = threading.Barrier(n)

    def one(i: int) -> tuple[int, dict[str, str]]:
        barrier.wait()
        return fn(i)  # type: ignore[no-any-return]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_concurrent_wrong_passwords_verify_at_most_the_limit(live: Live, verifications: list[int]) -> None:
    out = _burst(30, lambda i: live.login("wrong-guess", f"10.28.0.{i + 1}"))
    codes = sorted(c for c, _ in out)
    assert len(verifications) <= LIMIT, (len(verifications), codes)
    assert codes.count(401) == len(verifications) == LIMIT, codes  # nothing else got to hash
    assert codes.count(429) == 30 - LIMIT, codes
    assert all(int(h["retry-after"]) >= 1 for c, h in out if c == 429)
    # throttled now: even the right password is refused before hashing, from a new address
    before = len(verifications)
    code, headers = live.login("pw-right-123", "10.28.1.1")
    assert code == 429 and int(headers["retry-after"]) >= 1 and len(verifications) == before


def test_sequential_wrong_passwords_then_429(live: Live, verifications: list[int]) -> None:
    codes = [live.login("wrong-guess", "10.28.2.1")[0] for _ in range(12)]
    assert codes == [401] * LIMIT + [429] * (12 - LIMIT), codes
    assert len(verifications) == LIMIT


def test_bad_tokens_are_throttled_per_address(live: Live) -> None:
    codes = [live.bearer("fl_not-a-token", "10.28.3.1")[0] for _ in range(12)]
    assert codes == [401] * LIMIT + [429] * (12 - LIMIT), codes
    burst = sorted(c for c, _ in _burst(20, lambda i: live.bearer("fl_nope", "10.28.3.2")))
    assert burst.count(401) == LIMIT and burst.count(429) == 20 - LIMIT, burst
    assert live.bearer(live.token, "10.28.3.1")[0] == 200  # a valid token is never throttled
