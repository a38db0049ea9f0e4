"""Accounts that hold under attack (issue 21), through the real app on SQLite and PostgreSQL
(and Redis for the throttle counters): sessions end with their password or token, sign-in and
bad tokens are throttled with 429 + Retry-After and let the right password in after the delay,
a 30-way burst of submits accepts exactly the user's limit, the cost ceiling is a run time at
the measured throughput, and the embedded server answers only its own host names."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from compute.contract.settings import Settings
from tests.pg import pg_schema_url

ORIGIN = {"Origin": "http://testserver"}
PARAMS = 1_000_000


def _model_folder(path: Path, params: int = PARAMS) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2,
        "hidden_size": 32, "vocab_size": 20}))
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'  # valid, never loaded
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    (path / "fisherlens.json").write_text(json.dumps({"params": params}))
    return path


_n = iter(range(1, 1_000_000))


def _address() -> tuple[str, int]:
    """A client address of its own (throttling counts per address)."""
    n = next(_n)
    return (f"10.21.{n // 250}.{n % 250 + 1}", 50000)


class Env:
    def __init__(self, home: Path, db_url: str | None, **extra: Any):
        _model_folder(home / "zoo" / "arith-base")
        self.settings = Settings(
            fisherlens_home=home, database_url=db_url, redis_url=None,
            public_url="http://testserver", auth_required=True, max_active_jobs=50,
            signin_throttle="3/15 seconds;30/hour", token_throttle="5/15 seconds;100/hour",
            **extra,
        )
        from app.web import create_app
        from storage import users

        self.app = create_app(self.settings)
        self.tokens: dict[str, str] = {}
        with self.sessions() as s:
            for name, admin in (("alice", False), ("root", True), ("burst", False)):
                u = users.create_user(session=s, name=name, password=f"pw-{name}-123",
                                      is_admin=admin)
                self.tokens[name], _ = users.issue_token(session=s, user=u)
            users.set_limits(session=s, name="burst", max_active_jobs=3, max_job_cost=None)

    def sessions(self) -> Any:
        from app import services

        return services.sessions(self.settings)()

    def bearer(self, name: str) -> TestClient:
        return TestClient(self.app, follow_redirects=False, client=_address(),
                          headers={"Authorization": f"Bearer {self.tokens[name]}"})

    def sign_in(self, name: str, password: str | None = None) -> TestClient:
        c = TestClient(self.app, follow_redirects=False, client=_address())
        r = c.post("/login", data={"name": name, "password": password or f"pw-{name}-123"},
                   headers=ORIGIN)
        assert r.status_code == 303, r.text
        return c

    def cli(self, monkeypatch: pytest.MonkeyPatch, *args: str, input: str | None = None) -> str:
        from app.cli import main

        monkeypatch.setenv("FISHERLENS_HOME", str(self.settings.fisherlens_home))
        if self.settings.database_url:
            monkeypatch.setenv("DATABASE_URL", self.settings.database_url)
        else:
            monkeypatch.delenv("DATABASE_URL", raising=False)
        r = CliRunner().invoke(main, list(args), input=input)
        assert r.exit_code == 0, r.output
        return r.output


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    home = tmp_path_factory.mktemp("hold_home")
    if request.param == "sqlite":
        yield Env(home, None)
    else:
        with pg_schema_url("fl_hold") as url:
            yield Env(home, url)


# ---------------------------------------------------------------- sessions


def test_password_change_ends_every_session(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = env.sign_in("alice"), env.sign_in("alice")
    assert a.get("/api/me").json()["name"] == "alice" and b.get("/api/me").status_code == 200
    out = env.cli(monkeypatch, "user", "passwd", "alice", "--password-stdin", input="pw-alice-456\n")
    assert "2 browser session(s) ended" in out
    for c in (a, b):
        r = c.get("/api/me")
        assert r.status_code == 401 and "session has ended" in r.json()["detail"]
        assert c.post("/api/jobs", json={"kind": "fisher", "spec": {"model": "arith-base"}},
                      headers=ORIGIN).status_code == 401
    assert env.bearer("alice").get("/api/me").status_code == 200  # API tokens are not sessions
    # the user's own change through the API keeps the session that made it, ends the others
    mine, other = env.sign_in("alice", "pw-alice-456"), env.sign_in("alice", "pw-alice-456")
    r = mine.post("/api/me/password", headers=ORIGIN,
                  json={"current_password": "wrong-one", "new_password": "pw-alice-123"})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "current_password"
    r = mine.post("/api/me/password", headers=ORIGIN,
                  json={"current_password": "pw-alice-456", "new_password": "pw-alice-123"})
    assert r.status_code == 200 and r.json()["sessions_ended"] == 1, r.text
    assert mine.get("/api/me").status_code == 200 and other.get("/api/me").status_code == 401
    env.sign_in("alice")  # the new password works


def test_revoking_a_token_ends_the_sessions_it_opened(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    out = env.cli(monkeypatch, "user", "token", "alice", "--label", "laptop")
    token = next(w for w in out.split() if w.startswith("fl_"))
    by_token, by_password = env.sign_in("alice", token), env.sign_in("alice")
    assert by_token.get("/api/me").status_code == 200
    env.cli(monkeypatch, "user", "revoke", token[:10])
    assert by_token.get("/api/me").status_code == 401
    assert by_password.get("/api/me").status_code == 200  # opened with the password: unaffected
    assert TestClient(env.app, headers={"Authorization": f"Bearer {token}"},
                      client=_address()).get("/api/me").status_code == 401


def test_admin_ends_all_sessions_of_a_user(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    a = env.sign_in("alice")
    assert env.bearer("alice").post("/api/users/root/end-sessions").status_code == 403
    assert env.bearer("root").post("/api/users/nobody/end-sessions").status_code == 404
    r = env.bearer("root").post("/api/users/alice/end-sessions")
    assert r.status_code == 200 and r.json()["sessions_ended"] >= 1
    assert a.get("/api/me").status_code == 401
    a = env.sign_in("alice")
    assert "1 browser session(s) of alice ended" in env.cli(monkeypatch, "user", "end-sessions", "alice")
    assert a.get("/api/me").status_code == 401


# ---------------------------------------------------------------- throttling


def _wait_out(retry_after: str) -> None:
    time.sleep(int(retry_after) + 0.2)  # the server said how long; nothing else is waited for


def test_wrong_passwords_get_429_then_the_right_one_gets_in(env: Env) -> None:
    c = TestClient(env.app, follow_redirects=False, client=_address())
    codes = []
    for _ in range(10):
        r = c.post("/login", data={"name": "alice", "password": "not-it-at-all"}, headers=ORIGIN)
        codes.append(r.status_code)
        if r.status_code == 429:
            break
    assert codes[-1] == 429 and set(codes[:-1]) == {401}, codes
    assert int(r.headers["Retry-After"]) >= 1 and "try again in" in r.text
    # throttled: even the right password is refused, before it is hashed
    r = c.post("/login", data={"name": "alice", "password": "pw-alice-123"}, headers=ORIGIN)
    assert r.status_code == 429
    _wait_out(r.headers["Retry-After"])
    r = c.post("/login", data={"name": "alice", "password": "pw-alice-123"}, headers=ORIGIN)
    assert r.status_code == 303 and "fl_session=" in r.headers["set-cookie"]


def test_throttle_delays_grow_with_the_windows() -> None:
    """Stacked windows: past the short one the wait is its end; past the long one, the long
    one's end (counted in the `limits` memory storage)."""
    from limits.storage import MemoryStorage

    from app.auth.throttle import Throttle

    t = Throttle(MemoryStorage(), "2/2 seconds;4/hour")
    key = [("signin-ip", "10.0.0.1")]
    t.fail(key)
    assert t.retry_after(key) is None
    t.fail(key)
    first = t.retry_after(key)
    assert first is not None and 1 <= first <= 2
    time.sleep(first + 0.1)
    assert t.retry_after(key) is None
    t.fail(key)
    t.fail(key)
    second = t.retry_after(key)
    assert second is not None and second > 3000  # the hour's window, not the 2 s one
    assert t.retry_after([("signin-ip", "10.0.0.2")]) is None  # per key


def test_bad_tokens_get_429_per_address(env: Env) -> None:
    bad = TestClient(env.app, headers={"Authorization": "Bearer fl_not-a-token"}, client=_address())
    codes = [bad.get("/api/jobs").status_code for _ in range(10)]
    assert 429 in codes and set(codes[: codes.index(429)]) == {401}, codes
    r = bad.get("/api/jobs")
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert env.bearer("alice").get("/api/me").status_code == 200  # a valid token is not throttled
    _wait_out(r.headers["Retry-After"])
    assert bad.get("/api/jobs").status_code == 401


@pytest.mark.redis
def test_throttle_counts_live_in_redis_when_configured(tmp_path: Path) -> None:
    """With REDIS_URL the counters are in Redis, so every web process sees them: a second app
    (another process's view) is throttled by the first one's failures."""
    import os

    import redis

    url = os.environ.get("FISHERLENS_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001
        from tests.conftest import require_service

        require_service(f"Redis not reachable at {url} ({type(exc).__name__})")
    from app.auth import throttle

    settings = Settings(fisherlens_home=tmp_path, redis_url=url, signin_throttle="3/30 seconds")
    name = f"redis-user-{os.getpid()}-{time.time_ns()}"
    one, two = throttle.signin_throttle(settings), throttle.signin_throttle(settings)
    keys = [throttle.account_key(name)]
    for _ in range(3):
        one.fail(keys)
    wait = two.retry_after(keys)
    assert wait is not None and 1 <= wait <= 30
    client = redis.Redis.from_url(url)
    assert any(client.scan_iter(f"*{keys[0][1]}*"))
    two.clear(keys)
    assert one.retry_after(keys) is None


# ---------------------------------------------------------------- quotas


def test_a_30_way_burst_accepts_exactly_the_limit(env: Env) -> None:
    """30 concurrent submits by a user with max_active_jobs=3: exactly 3 are queued, the other
    27 get 429, on SQLite and on PostgreSQL (count and insert under a lock on the user's row)."""
    from app import services
    from storage import users
    from storage.models import Job

    client = env.bearer("burst")
    barrier = threading.Barrier(30)
    codes: list[int] = []
    lock = threading.Lock()

    def submit(i: int) -> None:
        barrier.wait()
        r = client.post("/api/jobs", json={"kind": "fisher", "spec": {
            "model": "arith-base", "prompts": 2, "samples": 1, "seed": i}})
        with lock:
            codes.append(r.status_code)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [201] * 3 + [429] * 27, codes
    with services.sessions(env.settings)() as s:
        owner = users.get_user(session=s, name="burst")
        assert owner is not None
        assert s.query(Job).filter(Job.owner_id == owner.id).count() == 3


# ---------------------------------------------------------------- cost ceiling


def test_time_ceiling_from_the_measured_throughput(tmp_path: Path) -> None:
    """Default: a user's job may run 2 h at the throughput of the committed benchmark; the
    message gives the estimate in time; a per-user limit or MAX_JOB_SECONDS raises it."""
    from app import limits
    from app.auth.principal import principal
    from compute.contract.specs import SpecError
    from compute.jobs.registry import parse_spec
    from storage.models import User

    committed = json.loads(limits.REPO_THROUGHPUT.read_text())["param_token_passes_per_s"]
    settings = Settings(fisherlens_home=tmp_path)
    assert limits.throughput(settings) == (committed, "throughput.json")
    user = User(id=7, name="u", is_admin=False, max_active_jobs=None, max_job_cost=None,
                max_job_seconds=None)
    p = principal(user, settings, "token")
    assert p.max_job_seconds == 7200 and p.max_job_cost == pytest.approx(7200 * committed)
    _model_folder(tmp_path / "zoo" / "arith-base")
    spec = parse_spec("train", {"model": "arith-base", "steps": 100_000, "batch": 8})
    est = limits.estimate(settings, "train", spec, limits.refs_for_estimate(settings, "train", spec))
    # priced by the reference machine's calibration (no calibration of this home): 8.5 h
    assert est["seconds_from"].startswith("the reference machine's calibration") and est["seconds"] > 7200
    with pytest.raises(SpecError) as exc:
        limits.check_cost(est, p.max_job_cost, p.max_job_seconds)
    msg = exc.value.errors[0]["message"]
    assert "not this machine's" in msg and "exceeds your per-job ceiling of 2.0 h" in msg
    # an operator's throughput file, a per-user time limit, an admin: each raises the ceiling
    (tmp_path / "throughput.json").write_text(json.dumps({"param_token_passes_per_s": 1e20}))
    assert limits.throughput(settings) == (1e20, "throughput.json")
    user.max_job_seconds = 10 * 3600
    assert principal(user, Settings(fisherlens_home=tmp_path / "none"), "token").max_job_cost == \
        pytest.approx(36000 * committed)
    user.is_admin, user.max_job_seconds = True, None
    assert principal(user, settings, "token").max_job_cost is None


# ---------------------------------------------------------------- embedded host allow-list


def test_embedded_server_answers_only_its_own_host_names(tmp_path: Path) -> None:
    from app.web import create_app

    settings = Settings(fisherlens_home=tmp_path, public_url="http://127.0.0.1:7860",
                        allowed_hosts="lab.example")
    app = create_app(settings)
    for base, code in (("http://127.0.0.1:7860", 200), ("http://localhost:7860", 200),
                       ("http://lab.example", 200), ("http://attacker.example", 403)):
        r = TestClient(app, base_url=base).get("/api/jobs")  # a plain GET, no browser headers
        assert r.status_code == code, (base, r.status_code)


# ---------------------------------------------------------------- exact API schema


def test_methods_a_route_does_not_serve_are_405_and_kind_is_an_enum(tmp_path: Path) -> None:
    from app.web import create_app

    settings = Settings(fisherlens_home=tmp_path, public_url="http://testserver")
    client = TestClient(create_app(settings))
    for path, allowed in (("/api/me", {"GET"}), ("/api/jobs", {"GET", "POST"}),
                          ("/api/estimate", {"POST"}), ("/api/models", {"GET", "POST"})):
        r = client.request("TRACE", path)
        assert r.status_code == 405, (path, r.status_code)
        assert set(r.headers["Allow"].split(", ")) - {"HEAD"} == allowed
    assert client.delete("/api/jobs/3").status_code == 405
    assert client.request("TRACE", "/api/no-such-thing").status_code == 404
    schema = client.get("/api/openapi.json").json()["components"]["schemas"]
    from compute.jobs.registry import KINDS

    assert schema["EstimateRequest"]["properties"]["kind"]["enum"] == list(KINDS)
    # a job request is one variant per kind (tests/unit/test_api.py checks each variant's spec)
    assert list(schema["JobRequest"]["discriminator"]["mapping"]) == list(KINDS)
    r = client.post("/api/jobs", json={"kind": "", "spec": {}})
    assert r.status_code == 422 and r.json()["detail"][0]["message"].startswith("unknown job kind ''; accepted: fisher")
