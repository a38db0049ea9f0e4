"""Where an authenticated GET /api/jobs spends its time, one part at a time (issue 28, item 7:
a first look, not the 50-client load benchmark): on PostgreSQL, one process, sequential calls,
the mean of 300 after a warm-up.

    FISHERLENS_TEST_PG_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test .venv/bin/python benchmarks/bench_auth_parts.py

Parts: the bearer token's look-up (token_principal: one indexed select, a write at most once a
minute), the job list of the caller (services.list_jobs with 2 jobs), the whole request through
FastAPI's TestClient (every middleware: guard, hygiene, Retry-After), /api/health for scale."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from fastapi.testclient import TestClient

    from app import services
    from app.auth.principal import acting_as, token_principal
    from app.web import create_app
    from compute.contract.settings import Settings
    from storage import repo, users
    from tests.pg import pg_schema_url

    home = Path(tempfile.mkdtemp(prefix="fl-bench-auth-"))
    (home / "zoo" / "arith-base").mkdir(parents=True)
    (home / "zoo" / "arith-base" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pg_schema_url("fl_bench_auth") as url:
        s = Settings(fisherlens_home=home, database_url=url, redis_url=None, auth_required=True,
                     public_url="http://testserver")
        app = create_app(s)
        with services.sessions(s)() as ss:
            u = users.create_user(session=ss, name="alice", password="pw-alice-123")
            tok, _ = users.issue_token(session=ss, user=u)
            for i in range(2):
                repo.create_job(session=ss, kind="fisher", spec={"model": "arith-base"},
                                spec_hash=f"h{i}", owner_id=u.id, refs={})
        p = token_principal(s, tok)
        c = TestClient(app)
        c.headers["Authorization"] = f"Bearer {tok}"

        def list_jobs() -> object:
            with acting_as(p):
                return services.list_jobs(s)

        for label, fn, n in (("token look-up", lambda: token_principal(s, tok), 300),
                             ("job list", list_jobs, 300),
                             ("GET /api/jobs (TestClient)", lambda: c.get("/api/jobs"), 300),
                             ("GET /api/health (TestClient)", lambda: c.get("/api/health"), 50)):
            fn()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            print(f"{label}: {(time.perf_counter() - start) / n * 1000:.2f} ms")


if __name__ == "__main__":
    main()
