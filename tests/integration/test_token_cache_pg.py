"""The web process's cache of verified tokens (issue 28, item 7; app/auth/token_cache.py), on
PostgreSQL: a hit needs no database, and a change committed by ANOTHER process (the CLI run as
its own `python` process) ends the token at once through LISTEN/NOTIFY, although the cache
would keep it for 300 s; a change in this process ends it synchronously. The job listing read
without the ORM (storage.jobs.list_job_dicts) gives exactly job_dict's dicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pg import pg_schema_url

pytestmark = pytest.mark.postgres
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Any]:
    from app import services
    from app.auth import token_cache
    from compute.contract.settings import Settings

    with pg_schema_url("fl_tokcache") as url:
        s = Settings(fisherlens_home=tmp_path, database_url=url, redis_url=None,
                     auth_required=True, token_cache_s=300)
        services.sessions(s)
        cache = token_cache.enable(s)
        assert cache is not None
        deadline = time.monotonic() + 30
        while not cache.listening and time.monotonic() < deadline:  # its LISTEN connection
            time.sleep(0.05)
        assert cache.listening
        try:
            yield s, cache
        finally:
            token_cache.disable(s)


def _user_and_token(s: Any, name: str) -> tuple[Any, str]:
    from app import services
    from storage import users

    with services.sessions(s)() as ss:
        u = users.create_user(session=ss, name=name, password=f"pw-{name}-123456")
        secret, _ = users.issue_token(session=ss, user=u, label="laptop")
        return u, secret


def _cli(s: Any, *args: str, stdin: str | None = None) -> str:
    """`fisherlens ...` in a process of its own (its own connection, its own memory)."""
    env = {**os.environ, "DATABASE_URL": s.database_url, "FISHERLENS_HOME": str(s.home)}
    out = subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, input=stdin)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _until_gone(s: Any, secret: str, kind: str | None = None) -> bool:
    from app.auth import token_principal

    deadline = time.monotonic() + 20  # NOTIFY arrives in milliseconds; 300 s is the cache's
    while time.monotonic() < deadline:
        if token_principal(s, secret, kind) is None:
            return True
        time.sleep(0.05)
    return False


def test_a_hit_needs_no_database_and_a_revoke_elsewhere_ends_it(pg: Any) -> None:
    from app.auth import token_principal
    from app.auth.principal import cached_token_principal

    s, cache = pg
    alice, secret = _user_and_token(s, "alice")
    assert cached_token_principal(s, secret) is None  # not verified yet: a miss, not a refusal
    p = token_principal(s, secret)
    assert p is not None and p.name == "alice" and p.via == "token"
    assert cached_token_principal(s, secret) == p  # now answered without the database
    _cli(s, "user", "revoke", secret[:10])  # another process: only the NOTIFY can tell us
    assert _until_gone(s, secret), "the revoked token still worked"
    assert cached_token_principal(s, secret) is None


def test_a_password_change_elsewhere_ends_a_cached_session(pg: Any) -> None:
    from app.auth import token_principal
    from storage import users

    s, cache = pg
    _user_and_token(s, "bob")
    from app import services

    with services.sessions(s)() as ss:  # a browser session of bob's
        bob = users.get_user(session=ss, name="bob")
        session_secret, _ = users.issue_token(session=ss, user=bob, kind="session", ttl_s=3600)
    p = token_principal(s, session_secret, kind="session")
    assert p is not None and p.via == "session"
    _cli(s, "user", "passwd", "bob", "--password-stdin", stdin="pw-bob-654321\n")
    assert _until_gone(s, session_secret, "session"), "the session outlived the new password"


def test_a_change_in_this_process_ends_it_at_once(pg: Any) -> None:
    from app import services
    from app.auth import token_principal
    from storage import users

    s, cache = pg
    _user_and_token(s, "carol")
    with services.sessions(s)() as ss:
        carol = users.get_user(session=ss, name="carol")
        secret, _ = users.issue_token(session=ss, user=carol, label="ci")
    assert token_principal(s, secret) is not None
    with services.sessions(s)() as ss:
        users.set_disabled(session=ss, name="carol", disabled=True)
    assert token_principal(s, secret) is None  # no wait: dropped when the change committed


def test_a_lookup_that_raced_a_change_is_not_stored(pg: Any) -> None:
    from app.auth import token_principal

    s, cache = pg
    _, secret = _user_and_token(s, "dave")
    p = token_principal(s, secret)
    assert p is not None
    cache.clear()
    stale = cache.generation - 1  # read before the change
    cache.put(secret, None, p, stale)
    assert cache.get(secret, None) is None


def test_listing_without_the_orm_is_job_dict(pg: Any) -> None:
    from app import services
    from storage import repo

    s, _ = pg
    alice, _ = _user_and_token(s, "erin")
    with services.sessions(s)() as ss:
        for i in range(4):
            job = repo.create_job(session=ss, kind="fisher" if i % 2 else "mask",
                                  spec={"model": "arith-base", "prompts": 8 + i, "nested": [1, i]},
                                  spec_hash=f"h{i}", owner_id=alice.id if i < 3 else None, refs={})
            if i == 1:
                repo.claim_job(session=ss, job_id=job.id, worker="w", stale_after_s=60)
                repo.update_progress(session=ss, job_id=job.id, fraction=0.5, message="half")
        for filters in ({}, {"owner_id": alice.id}, {"kind": "fisher"}, {"status": "running"},
                        {"limit": 2, "offset": 1}, {"owner_id": alice.id, "kind": "mask"}):
            orm = [repo.job_dict(j) for j in repo.list_jobs(session=ss, **filters)]
            core = repo.list_job_dicts(session=ss, **filters)
            assert json.dumps(core, sort_keys=True) == json.dumps(orm, sort_keys=True), filters
            assert core, filters
