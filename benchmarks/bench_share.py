"""Share page under load: N concurrent readers of /r/<token> against a real uvicorn server.

For each database (SQLite, PostgreSQL):
1. a fresh FISHERLENS_HOME (and, for PostgreSQL, a fresh database `fl_bench_share`) holding
   real results computed once on the zoo model: a Fisher job, a checkpoint diff against it
   (arith-base -> arith-teacher) and a token-explorer job;
2. `python -m uvicorn --factory app.web:create_app` (one process, as `fisherlens up` serves);
3. the first view of each result (this builds and stores its figures), timed alone;
4. `--readers` clients, each on its own keep-alive connection, GET /r/<token> (round-robin
   over the results, `Accept-Encoding: gzip` like a browser, no cache) back to back for
   `--seconds`; latency of every request, from sending it to the last byte of the body.
   Closed loop: each reader sends its next request as soon as the previous one is answered, so
   this is the worst case of 50 people opening the link at once, not a polite reader.
Then (with `--ui`, needs playwright + Chromium): the time for a browser to draw every figure of
a result on the share page, and when the result is reopened in the explorer's result tab.

The load generator is a minimal asyncio HTTP/1.1 client (no library overhead) in this process,
on the same machine as the server: its CPU use is part of the load. It stops by itself after
`--seconds` (requests in flight are awaited, at most `--readers` of them).

    .venv/bin/python benchmarks/bench_share.py                # SQLite and PostgreSQL, 50 x 30 s
    .venv/bin/python benchmarks/bench_share.py --db sqlite --seconds 5 --readers 10 --no-save

Results: benchmarks/results/bench_share-<UTC time>.json and bench_share-latest.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
PG_DB = "fl_bench_share"


# ---------------------------------------------------------------- results to serve


def compute_results(zoo_home: Path) -> list[Any]:
    """Real JobResults on the zoo: fisher, diff (base -> teacher, with that Fisher), tokens."""
    os.environ["FISHERLENS_HOME"] = str(zoo_home)
    from safetensors.torch import save_file

    from compute.jobs import diff_run as run_diff
    from compute.jobs import run_fisher, run_tokens
    from compute.jobs.diff import DiffSpec
    from compute.jobs.fisher import FisherSpec
    from compute.jobs.tokens import TokensSpec

    fisher = run_fisher.run(FisherSpec(model="arith-base", prompts=16, samples=2, seed=0, device="cpu"))
    fpath = Path(tempfile.mkdtemp(prefix="bench-share-")) / "fisher.safetensors"
    save_file({n: t.contiguous() for n, t in fisher.tensors["fisher"].items()}, str(fpath))
    diff = run_diff.run(DiffSpec(base="arith-base", tuned="arith-teacher", fisher=str(fpath)))
    tokens = run_tokens.run(TokensSpec(model="arith-base", context="12+34=", device="cpu"))
    return [fisher, diff, tokens]


def seed_database(settings: Any, results: list[Any]) -> list[str]:
    """Store each result as a succeeded job; returns their share tokens."""
    from app import services
    from storage import repo
    from storage.artifacts import open_store

    tokens = []
    with services.sessions(settings)() as s:
        for i, res in enumerate(results):
            job = repo.create_job(session=s, kind=res.kind, spec={"model": "arith-base", "bench": i},
                                  spec_hash=f"bench-share-{i}")
            repo.claim_job(session=s, job_id=job.id, worker="bench", stale_after_s=3600)
            repo.save_result(session=s, job_id=job.id, result=res,
                             store=open_store(settings))
            repo.mark_succeeded(session=s, job_id=job.id)
            tokens.append(job.share_token)
    return tokens


def fresh_pg_database() -> str:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {PG_DB}")
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{PG_DB}"


def drop_pg_database() -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)")


# ---------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(home: Path, db_url: str | None, port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "PUBLIC_URL")}
    env.update(FISHERLENS_HOME=str(home), GRADIO_ANALYTICS_ENABLED="False", OMP_NUM_THREADS="1",
               PUBLIC_URL=f"http://127.0.0.1:{port}")
    if db_url:
        env["DATABASE_URL"] = db_url
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "app.web:create_app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
        cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"uvicorn exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5):
                return proc
        except OSError:
            if time.monotonic() > deadline:
                stop_server(proc)
                raise RuntimeError(f"uvicorn did not answer in 180 s; see {log}") from None
            time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- load


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int,
               path: str) -> tuple[int, int]:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/html\r\n"
                 "Accept-Encoding: gzip\r\nConnection: keep-alive\r\n\r\n".encode())
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        if k.strip().lower() == "content-length":
            length = int(v)
    await reader.readexactly(length)
    return status, length


async def _reader(port: int, paths: list[str], start: int, deadline: float,
                  lat: list[float], codes: dict[int, int], sizes: list[int]) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    i = start
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            status, n = await _get(r, w, port, paths[i % len(paths)])
            lat.append(time.perf_counter() - t0)
            codes[status] = codes.get(status, 0) + 1
            sizes.append(n)
            i += 1
    finally:
        w.close()


def load(port: int, paths: list[str], readers: int, seconds: float) -> dict[str, Any]:
    lat: list[float] = []
    codes: dict[int, int] = {}
    sizes: list[int] = []

    async def main() -> float:
        t0 = time.perf_counter()
        deadline = t0 + seconds
        await asyncio.gather(*[_reader(port, paths, k, deadline, lat, codes, sizes)
                               for k in range(readers)])
        return time.perf_counter() - t0

    wall = asyncio.run(main())
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {
        "requests": len(lat), "wall_s": round(wall, 2), "throughput_rps": round(len(lat) / wall, 1),
        "p50_ms": round(1000 * q[49], 1), "p95_ms": round(1000 * q[94], 1),
        "p99_ms": round(1000 * q[98], 1), "max_ms": round(1000 * max(lat), 1),
        "mean_ms": round(1000 * statistics.fmean(lat), 1), "status_codes": codes,
        "mean_body_bytes": round(statistics.fmean(sizes)),
    }


def first_views(port: int, tokens: list[str]) -> list[dict[str, Any]]:
    out = []
    for tok in tokens:
        t0 = time.perf_counter()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/r/{tok}")
        with urllib.request.urlopen(req, timeout=120) as r:
            body = r.read()
        out.append({"ms": round(1000 * (time.perf_counter() - t0), 1), "html_bytes": len(body),
                    "figures": body.count(b"class='fl-fig'")})
    return out


# ---------------------------------------------------------------- browser timings


def browser_timings(port: int, tokens: list[str], repeats: int) -> dict[str, Any]:
    """Seconds until every figure is drawn: the share page, and the explorer's result tab."""
    from playwright.sync_api import sync_playwright

    from app.ui import MAX_FIGS  # figure slots of the explorer's result tab

    chromium = os.environ.get("FISHERLENS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    base = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"share_page_s": [], "ui_result_tab_s": [], "ui_header_to_figures_s": [],
                           "ui_switch_s": []}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            for _ in range(repeats):
                for tok in tokens:
                    ctx = b.new_context(viewport={"width": 1360, "height": 900})
                    page = ctx.new_page()
                    t0 = time.perf_counter()
                    page.goto(f"{base}/r/{tok}")
                    page.wait_for_function("() => { const f = document.querySelectorAll('figure.fl-fig');"
                                           " return f.length > 0 && [...f].every(x =>"
                                           " x.querySelector('.js-plotly-plot .main-svg')); }", timeout=60_000)
                    out["share_page_s"].append(round(time.perf_counter() - t0, 3))
                    n = min(MAX_FIGS, page.eval_on_selector_all("figure.fl-fig", "els => els.length"))
                    t0 = time.perf_counter()  # reopen the same result in the explorer
                    page.goto(f"{base}/?tab=result&r={tok}")
                    page.wait_for_selector("#fl-progress .fl-progress[data-status='succeeded']",
                                           timeout=60_000)
                    t_head = time.perf_counter()
                    page.wait_for_function(
                        "() => [...document.querySelectorAll('.fl-fig')].filter(x =>"
                        f" x.querySelector('.js-plotly-plot .main-svg')).length >= {n}", timeout=60_000)
                    out["ui_result_tab_s"].append(round(time.perf_counter() - t0, 3))
                    out["ui_header_to_figures_s"].append(round(time.perf_counter() - t_head, 3))
                    # switch the open explorer to another result (no page load): the result picker
                    other = tokens[(tokens.index(tok) + 1) % len(tokens)]
                    if other != tok:
                        title = page.eval_on_selector("#fl-fig-0 .js-plotly-plot", "el => el.layout.title.text")
                        t0 = time.perf_counter()
                        page.fill("#result-pick input", other)
                        page.keyboard.press("Enter")
                        page.wait_for_function(
                            "() => { const el = document.querySelector('#fl-fig-0 .js-plotly-plot');"
                            f" return el && el.layout && el.layout.title.text !== {json.dumps(title)}; }}",
                            timeout=60_000)
                        out["ui_switch_s"].append(round(time.perf_counter() - t0, 3))
                    ctx.close()
        finally:
            b.close()
    for k in ("share_page_s", "ui_result_tab_s", "ui_header_to_figures_s", "ui_switch_s"):
        v = out[k]
        out[k[:-2] + "_median_s"] = round(statistics.median(v), 3)
        out[k[:-2] + "_max_s"] = max(v)
    return out


# ---------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    top = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True).stdout
    return {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "top_processes": top.splitlines()[1:6]}


def run_backend(name: str, results: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    from compute.contract.settings import Settings

    home = Path(tempfile.mkdtemp(prefix=f"bench-share-{name}-"))
    db_url = fresh_pg_database() if name == "postgresql" else None
    try:
        settings = Settings(fisherlens_home=home, database_url=db_url, redis_url=None)
        tokens = seed_database(settings, results)
        port = free_port()
        proc = start_server(home, db_url, port, home / "server.log")
        try:
            before = machine()
            cold = first_views(port, tokens)
            cpu0 = cpu_seconds(proc.pid)
            stats = load(port, [f"/r/{t}" for t in tokens], args.readers, args.seconds)
            stats["server_cpu_s"] = round(cpu_seconds(proc.pid) - cpu0, 1)
            out = {"db": name, "machine_before": before, "machine_after": machine(),
                   "first_view": cold, **stats}
            if args.ui:
                out["browser"] = browser_timings(port, tokens, args.ui_repeats)
            return out
        finally:
            stop_server(proc)
    finally:
        if db_url:
            drop_pg_database()
        shutil.rmtree(home, ignore_errors=True)


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Share page `/r/<token>`: {report['readers']} concurrent readers (closed loop, keep-alive, "
             f"gzip) for {report['seconds']} s against one uvicorn process on {report['cpus']} CPU cores; "
             f"load generator on the same machine. Run {report['started']}.", "",
             "| database | requests | throughput (req/s) | p50 (ms) | p95 (ms) | p99 (ms) | max (ms) | errors | "
             "first view (build figures, ms) | load avg before |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in report["runs"]:
        errors = sum(v for k, v in r["status_codes"].items() if int(k) != 200)
        first = ", ".join(f"{v['ms']:.0f}" for v in r["first_view"])
        lines.append(f"| {r['db']} | {r['requests']} | {r['throughput_rps']} | {r['p50_ms']} | {r['p95_ms']} | "
                     f"{r['p99_ms']} | {r['max_ms']} | {errors} | {first} | "
                     f"{' '.join(str(x) for x in r['machine_before']['loadavg'])} |")
    for r in report["runs"]:
        if "browser" in r:
            b = r["browser"]
            lines.append("")
            lines.append(f"{r['db']}: all figures drawn in Chromium: share page median "
                         f"{b['share_page_median_s']} s (max {b['share_page_max_s']} s); result reopened "
                         f"in the explorer (page load included) median {b['ui_result_tab_median_s']} s "
                         f"(max {b['ui_result_tab_max_s']} s), of which from its header to all figures "
                         f"median {b['ui_header_to_figures_median_s']} s (max {b['ui_header_to_figures_max_s']} s); "
                         f"{len(b['ui_result_tab_s'])} openings. Switching the open explorer to another "
                         f"result (result picker, no page load) until its first figure is drawn: median "
                         f"{b['ui_switch_median_s']} s (max {b['ui_switch_max_s']} s).")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", choices=["sqlite", "postgresql", "both"], default="both")
    ap.add_argument("--readers", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--zoo", type=Path, default=Path(os.environ.get("FISHERLENS_TEST_ZOO", ".fisherlens")),
                    help="a FISHERLENS_HOME whose zoo/ holds arith-base and arith-teacher")
    ap.add_argument("--ui", action="store_true", help="also time figure drawing in Chromium (playwright)")
    ap.add_argument("--ui-repeats", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if not 1 <= args.readers <= 1000 or not 1 <= args.seconds <= 600:
        ap.error("--readers: 1..1000; --seconds: 1..600")
    if not (args.zoo / "zoo" / "arith-teacher").is_dir():
        ap.error(f"--zoo: {args.zoo}/zoo has no arith-base/arith-teacher; run `fisherlens zoo build`")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    t0 = time.perf_counter()
    results = compute_results(args.zoo.resolve())
    print(f"computed {len(results)} results in {time.perf_counter() - t0:.1f} s", flush=True)
    names = ["sqlite", "postgresql"] if args.db == "both" else [args.db]
    runs = []
    for name in names:
        r = run_backend(name, results, args)
        print(json.dumps({k: v for k, v in r.items() if k not in ("machine_before", "machine_after")}),
              flush=True)
        runs.append(r)
    report = {"benchmark": "share_page", "started": started, "readers": args.readers,
              "seconds": args.seconds, "cpus": os.cpu_count(), "python": sys.version.split()[0],
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": git_commit(),
              "runs": runs}
    md = markdown(report)
    print(md)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = started.replace("-", "").replace(":", "").replace("T", "-").rstrip("Z")
        (RESULTS / f"bench_share-{stamp}.json").write_text(json.dumps(report, indent=1) + "\n")
        (RESULTS / "bench_share-latest.md").write_text(md)
        print(f"wrote {RESULTS / f'bench_share-{stamp}.json'} and bench_share-latest.md")


if __name__ == "__main__":
    main()
