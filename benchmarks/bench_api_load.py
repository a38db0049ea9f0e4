"""The authenticated API under load (issue 28, item 7): 50 concurrent signed-in clients on
`GET /api/jobs` (bearer token), side by side in the same run with 50 readers of a share page.

1. a fresh FISHERLENS_HOME with the zoo, and a fresh PostgreSQL schema at FISHERLENS_TEST_PG_URL
   (or --pg-url), holding a user `alice` with an API token and her jobs: a succeeded Fisher job
   (a real result on arith-base, its share link turned on), 2 running, 2 queued;
2. `python -m uvicorn --factory app.web:create_app` with AUTH_REQUIRED=true (one process, as
   `fisherlens up` serves; no Redis: a valid token costs no throttle look-up either way);
3. phases of `--seconds` each, every client on its own keep-alive connection, closed loop (the
   next request as soon as the previous one is answered: the worst case, not a polite poller):
   - `api`: `--clients` clients on GET /api/jobs with `Authorization: Bearer <token>`;
   - `share`: `--clients` readers of GET /r/<token> (no credentials);
   - `mixed`: both at once (2 x `--clients` connections), each side reported apart;
   latency of every request from sending it to the last byte of the body; an error is a status
   other than 200 or a broken connection (the client reconnects and goes on).
4. the load average and the busiest processes before and after (the machine is shared), the
   server's CPU seconds per phase.

The load generator is a minimal asyncio HTTP/1.1 client in this process, on the same machine as
the server: its CPU use is part of the load.

    FISHERLENS_TEST_PG_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        nice -n 5 .venv/bin/python benchmarks/bench_api_load.py            # 50 clients x 15 s
    .venv/bin/python benchmarks/bench_api_load.py --seconds 3 --clients 10 --no-save

Result: benchmarks/results/bench_api_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_share import (  # noqa: E402 - after the path
    cpu_seconds,
    free_port,
    git_commit,
    machine,
    start_server,
    stop_server,
)

RESULTS = ROOT / "benchmarks" / "results"


# ---------------------------------------------------------------- the data


def seed(settings: Any, zoo_home: Path) -> tuple[str, str]:
    """alice, her API token and 5 jobs (one succeeded with a real Fisher result and its share
    link on, 2 running, 2 queued); returns (bearer token, share token)."""
    from app import services
    from compute.jobs import fisher_run
    from compute.jobs.fisher import FisherSpec
    from storage import repo, users
    from storage.artifacts import open_store

    os.environ["FISHERLENS_HOME"] = str(zoo_home)
    result = fisher_run.run(FisherSpec(model="arith-base", prompts=16, samples=2, seed=0,
                                       device="cpu"))
    with services.sessions(settings)() as s:
        alice = users.create_user(session=s, name="alice", password="pw-alice-123456")
        bearer, _ = users.issue_token(session=s, user=alice, label="bench")
        done = repo.create_job(session=s, kind="fisher", spec={"model": "arith-base"},
                               spec_hash="bench-api-done", owner_id=alice.id, refs={},
                               shared=True)
        repo.claim_job(session=s, job_id=done.id, worker="bench", stale_after_s=3600)
        repo.save_result(session=s, job_id=done.id, result=result, store=open_store(settings))
        repo.mark_succeeded(session=s, job_id=done.id)
        for i in range(4):
            job = repo.create_job(session=s, kind="fisher",
                                  spec={"model": "arith-base", "prompts": 8 + i},
                                  spec_hash=f"bench-api-{i}", owner_id=alice.id, refs={})
            if i < 2:  # running: claimed by a (pretend) worker, with progress
                repo.claim_job(session=s, job_id=job.id, worker="bench", stale_after_s=3600)
                repo.update_progress(session=s, job_id=job.id, fraction=0.3, message="step 3/10")
        return bearer, done.share_token


# ---------------------------------------------------------------- load


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int,
               path: str, headers: str) -> int:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}"
                 "Connection: keep-alive\r\n\r\n".encode())
    await writer.drain()
    line = await reader.readline()
    if not line:
        raise ConnectionError("closed by the server")
    status = int(line.split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        if k.strip().lower() == "content-length":
            length = int(v)
    await reader.readexactly(length)
    return status


class Side:
    """One kind of client: its path, headers and what it measured."""

    def __init__(self, name: str, path: str, headers: str):
        self.name, self.path, self.headers = name, path, headers
        self.lat: list[float] = []
        self.codes: dict[int, int] = {}
        self.conn_errors = 0

    async def client(self, port: int, deadline: float) -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = await asyncio.open_connection("127.0.0.1", port)
                status = await _get(*conn, port, self.path, self.headers)
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
                self.conn_errors += 1
                if conn is not None:
                    conn[1].close()
                conn = None
                await asyncio.sleep(0.05)
                continue
            self.lat.append(time.perf_counter() - t0)
            self.codes[status] = self.codes.get(status, 0) + 1
        if conn is not None:
            conn[1].close()

    def report(self, wall: float) -> dict[str, Any]:
        lat = self.lat or [float("nan")]
        q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else [lat[0]] * 99
        errors = sum(n for c, n in self.codes.items() if c != 200) + self.conn_errors
        return {"path": self.path.split("/r/")[0] + ("/r/<token>" if "/r/" in self.path else ""),
                "requests": len(self.lat), "throughput_rps": round(len(self.lat) / wall, 1),
                "p50_ms": round(1000 * q[49], 1), "p95_ms": round(1000 * q[94], 1),
                "p99_ms": round(1000 * q[98], 1), "max_ms": round(1000 * max(lat), 1),
                "errors": errors, "connection_errors": self.conn_errors,
                "status_codes": {str(k): v for k, v in sorted(self.codes.items())}}


def run_phase(port: int, sides: list[tuple[Side, int]], seconds: float) -> dict[str, Any]:
    async def main() -> float:
        t0 = time.perf_counter()
        deadline = t0 + seconds
        await asyncio.gather(*[side.client(port, deadline) for side, n in sides for _ in range(n)])
        return time.perf_counter() - t0

    wall = asyncio.run(main())
    return {"wall_s": round(wall, 2), **{side.name: side.report(wall) for side, _ in sides}}


def check_answers(port: int, bearer: str, share: str) -> None:
    """Before timing: the token lists alice's 5 jobs, no token is 401, the share page is 200."""
    import urllib.error
    import urllib.request

    base = f"http://127.0.0.1:{port}"
    req = urllib.request.Request(f"{base}/api/jobs", headers={"Authorization": f"Bearer {bearer}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        jobs = json.loads(r.read())
    assert len(jobs) == 5, f"expected alice's 5 jobs, got {len(jobs)}"
    try:
        urllib.request.urlopen(f"{base}/api/jobs", timeout=60)
        raise AssertionError("GET /api/jobs without a token answered 200")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401, exc.code
    with urllib.request.urlopen(f"{base}/r/{share}", timeout=120) as r:
        assert r.status == 200 and b"fl-fig" in r.read()


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--pg-url", default=os.environ.get(
        "FISHERLENS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if not 1 <= args.clients <= 500 or not 1 <= args.seconds <= 600:
        ap.error("--clients: 1..500; --seconds: 1..600")
    os.environ["FISHERLENS_TEST_PG_URL"] = args.pg_url
    from compute.contract.settings import Settings
    from compute.zoo import build_zoo
    from tests.pg import pg_schema_url

    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    home = Path(tempfile.mkdtemp(prefix="bench-api-load-"))
    build_zoo(home / "zoo")
    os.environ.pop("REDIS_URL", None)
    try:
        with pg_schema_url("fl_bench_api") as url:
            settings = Settings(fisherlens_home=home, database_url=url, redis_url=None,
                                auth_required=True)
            bearer, share = seed(settings, home)
            port = free_port()
            os.environ["AUTH_REQUIRED"] = "true"  # the server inherits it
            proc = start_server(home, url, port, home / "server.log")
            try:
                check_answers(port, bearer, share)
                before = machine()
                phases: dict[str, Any] = {}
                auth_hdr = f"Authorization: Bearer {bearer}\r\nAccept: application/json\r\n"
                share_hdr = "Accept: text/html\r\nAccept-Encoding: gzip\r\n"
                plan = {"api": [("api", args.clients)], "share": [("share", args.clients)],
                        "mixed": [("api", args.clients), ("share", args.clients)]}
                for name, parts in plan.items():
                    sides = [(Side("api", "/api/jobs", auth_hdr) if k == "api"
                              else Side("share", f"/r/{share}", share_hdr), n) for k, n in parts]
                    cpu0 = cpu_seconds(proc.pid)
                    phases[name] = run_phase(port, sides, args.seconds)
                    phases[name]["server_cpu_s"] = round(cpu_seconds(proc.pid) - cpu0, 1)
                    phases[name]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
                    print(name, json.dumps(phases[name]), flush=True)
                after = machine()
            finally:
                stop_server(proc)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    report = {"benchmark": "api_load", "started": started, "clients": args.clients,
              "seconds_per_phase": args.seconds, "database": "postgresql", "auth_required": True,
              "cpus": os.cpu_count(), "python": sys.version.split()[0],
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": git_commit(),
              "machine_before": before, "machine_after": after, "phases": phases}
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / "bench_api_load.json"
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
