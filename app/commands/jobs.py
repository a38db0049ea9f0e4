"""Job commands: up, worker, submit, status, jobs, workers, cancel, rerun, db upgrade.

Only `worker` and `up` (zoo build) import compute code that needs torch, inside the command.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

from app.commands.common import fail
from compute.contract.settings import get_settings
from compute.jobs.registry import NAMES as KIND_NAMES

FINAL = ("succeeded", "failed", "cancelled")


def _load_spec(text: str) -> dict[str, Any]:
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        if not path.is_file():
            fail(f"--spec: file {str(path)!r} does not exist")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"--spec: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
    if not isinstance(data, dict):
        fail('--spec: must be a JSON object, e.g. \'{"model": "arith-base"}\'')
    return data


@click.command("submit")
@click.argument("kind")
@click.option(
    "--spec",
    "spec_text",
    default="{}",
    show_default=True,
    help="JSON object of the job's options (the matching command's flag names), or @file.json",
)
@click.option("--no-reuse", is_flag=True, help="Compute again even if an identical result exists.")
@click.option("--wait", is_flag=True, help="Wait until the job ends (exit 1 unless it succeeded).")
@click.option("--timeout", default=3600.0, show_default=True, help="Seconds to --wait at most.")
@click.option("--yes", "-y", is_flag=True,
              help="queue it although its estimated run time is above CONFIRM_ABOVE_S (default 1 h)")
@click.option("--dry-run", is_flag=True, help="print the estimated time and peak memory; queue nothing")
def submit_cmd(kind: str, spec_text: str, no_reuse: bool, wait: bool, timeout: float, yes: bool,
               dry_run: bool) -> None:
    """Queue a job of KIND (a registered job kind) for the workers."""
    from app import client as services  # HTTP with a token, or in-process (app/client.py)
    from app.limits import ConfirmationRequired
    from compute.contract.specs import SpecError

    settings = get_settings()
    data = _load_spec(spec_text)
    if dry_run:
        from app.commands.kinds import estimate_lines
        from compute.jobs.registry import parse_spec

        try:
            spec = parse_spec(kind, data)
        except SpecError as exc:
            fail("; ".join(f"{e['field']}: {e['message']}" for e in exc.errors))
        for line in estimate_lines(kind, spec)[1]:
            click.echo(line)
        click.echo("dry run: nothing was submitted")
        return
    try:
        try:
            job = services.submit(settings, kind, data, reuse=not no_reuse, confirm=yes)
        except ConfirmationRequired as exc:
            message = exc.errors[0]["message"].split(": resend")[0]
            if not sys.stdin.isatty():
                fail(f"--yes: {message}; submit again with --yes to queue it (no terminal to ask)")
            if not click.confirm(f"{message}. Queue it?", default=False):
                fail("not confirmed: nothing was queued", code=1)
            job = services.submit(settings, kind, data, reuse=not no_reuse, confirm=True)
    except SpecError as exc:
        fail("; ".join(f"{e['field']}: {e['message']}" for e in exc.errors))
    except RuntimeError as exc:
        fail(str(exc), code=1)
    how = "reused (identical spec, same model revision)" if job["reused"] else "queued"
    click.echo(f"job {job['id']} {how}: {job['status']}")
    click.echo(f"share link: {job['share_url']}")
    if wait:
        _wait_and_exit(settings, job["id"], timeout)


submit_cmd.help = f"Queue a job of KIND ({', '.join(KIND_NAMES)}) for the workers."


@click.command("status")
@click.argument("job_id", type=int)
@click.option("--wait", is_flag=True, help="Wait until the job ends (exit 1 unless it succeeded).")
@click.option("--timeout", default=3600.0, show_default=True, help="Seconds to --wait at most.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole job row as JSON.")
def status_cmd(job_id: int, wait: bool, timeout: float, as_json: bool) -> None:
    """Print a job's status: queued, running, succeeded, failed or cancelled."""
    from app import client as services  # HTTP with a token, or in-process (app/client.py)

    settings = get_settings()
    if wait:
        _wait_and_exit(settings, job_id, timeout, as_json=as_json)
    job = services.get_job(settings, job_id)
    if job is None:
        fail(f"JOB: no job with id {job_id}")
    click.echo(json.dumps(job, indent=2) if as_json else job["status"])


def _wait_and_exit(settings: Any, job_id: int, timeout: float, as_json: bool = False) -> None:
    from app import client as services  # HTTP with a token, or in-process (app/client.py)

    deadline = time.monotonic() + timeout
    last = None
    while True:
        job = services.get_job(settings, job_id)
        if job is None:
            fail(f"JOB: no job with id {job_id}")
        line = f"{job['status']} {job['progress']:.0%} {job['message']}"
        if line != last and not as_json and sys.stderr.isatty():
            click.echo(line, err=True)
        last = line
        if job["status"] in FINAL or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    click.echo(json.dumps(job, indent=2) if as_json else job["status"])
    if job["status"] == "failed" and job.get("message"):
        click.echo(f"error: {job['message']}", err=True)
    raise SystemExit(0 if job["status"] == "succeeded" else 1)


@click.command("jobs")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 1000))
@click.option(
    "--status", type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"])
)
@click.option("--kind", default=None, help="Only jobs of this kind.")
def jobs_cmd(limit: int, status: str | None, kind: str | None) -> None:
    """List recent jobs, newest first."""
    from app import client as services  # HTTP with a token, or in-process (app/client.py)

    rows = services.list_jobs(get_settings(), limit=limit, status=status, kind=kind)
    click.echo(f"{'id':>5}  {'kind':<9} {'status':<10} {'progress':>8}  {'created':<19}  message")
    for j in rows:
        created = (j["created_at"] or "")[:19].replace("T", " ")
        click.echo(
            f"{j['id']:>5}  {j['kind']:<9} {j['status']:<10} {j['progress']:>8.0%}  "
            f"{created:<19}  {(j['message'] or '')[:60]}"
        )


@click.command("workers")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON of GET /api/workers.")
def workers_cmd(as_json: bool) -> None:
    """The live workers' devices, and what a queued job is checked against and priced by."""
    from app import client as services  # HTTP with a token, or in-process (app/client.py)
    from app.limits import size_text
    from app.services.workers import rate_text

    out = services.workers(get_settings())
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return

    def size(n: Any) -> str:
        return "-" if n is None else size_text(float(n))

    rows = out["workers"]
    if rows:
        click.echo(f"{'worker':<24} {'device':<7} {'name':<24} {'free for a job':>14} {'total':>9} "
                   f"{'host free':>9}  {'calibration (per token-pass)':<32} seen")
    for w in rows:
        cal = rate_text(w["calibration"]).removesuffix(" per token-pass")
        click.echo(f"{w['name'][:24]:<24} {w['device'][:7]:<7} {(w['device_name'] or '')[:24]:<24} "
                   f"{size(w['free_bytes']):>14} {size(w['total_bytes']):>9} {size(w['host_free_bytes']):>9}  "
                   f"{cal:<32} {w['seen_seconds_ago']:.0f} s ago")
    click.echo(out["note"] + ".")
    for spec, fig in out["checked_against"].items():
        click.echo(f"a queued job on device {spec!r} is checked against: "
                   f"{size(fig['free_bytes'])} ({fig['where']})")
    p = out["priced_by"]
    click.echo("estimates are priced by: " + ("THROUGHPUT (one constant)" if p is None else
               f"{rate_text(p)} ({p['where']})"))


@click.command("cancel")
@click.argument("job_id", type=int)
def cancel_cmd(job_id: int) -> None:
    """Cancel a queued job, or ask a running one to stop at its next progress report."""
    from app import client as services  # HTTP with a token, or in-process (app/client.py)

    try:
        job = services.cancel(get_settings(), job_id)
    except LookupError as exc:
        fail(str(exc))
    word = "cancel requested" if job["status"] == "running" else job["status"]
    click.echo(f"job {job_id}: {word}")


@click.command("rerun")
@click.argument("job_id", type=int)
def rerun_cmd(job_id: int) -> None:
    """Queue a new job with the same spec as JOB_ID (computed again, not reused)."""
    from app import client as services  # HTTP with a token, or in-process (app/client.py)

    try:
        job = services.rerun(get_settings(), job_id)
    except (LookupError, ValueError) as exc:
        fail(str(exc))
    click.echo(f"job {job['id']} queued (rerun of {job_id})")
    click.echo(f"share link: {job['share_url']}")


@click.group("db")
def db_group() -> None:
    """Database maintenance."""


@db_group.command("upgrade")
def db_upgrade_cmd() -> None:
    """Apply the database migrations (the app and workers also do this at start-up)."""
    from storage.db import upgrade

    settings = get_settings()
    upgrade(settings.db_url)
    click.echo(f"database at head: {_safe_url(settings.db_url)}")


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@click.command("worker")
@click.option(
    "--name",
    default=None,
    help="Celery node name; must be unique among running workers. Default worker-PID@HOST "
    "(gpuN-PID@HOST with --gpu N): unique per process, and a worker on the same host can tell "
    "when that process is gone. A fixed name lets a restarted worker re-queue the job its "
    "previous process was running at once, at start-up.",
)
@click.option(
    "--gpu",
    default=None,
    type=click.IntRange(0, 1023),
    help="Pin this worker to one GPU (sets CUDA_VISIBLE_DEVICES). Run one worker per GPU.",
)
@click.option("--loglevel", default="INFO", show_default=True)
def worker_cmd(name: str | None, gpu: int | None, loglevel: str) -> None:
    """Run one job worker (solo pool: one job at a time, one worker per GPU)."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    from storage.db import upgrade

    upgrade(get_settings().db_url)
    from compute.worker import celery_app, default_worker_name, worker_argv

    name = name or default_worker_name("worker" if gpu is None else f"gpu{gpu}")

    celery_app.worker_main(worker_argv(name=name, loglevel=loglevel))


@click.command("up")
@click.option("--host", default=None, help="Interface for the web app (default: settings HOST).")
@click.option("--port", default=None, type=click.IntRange(1, 65535), help="Port (default: PORT).")
@click.option("--no-worker", is_flag=True, help="Start only the web app (workers run elsewhere).")
def up_cmd(host: str | None, port: int | None, no_worker: bool) -> None:
    """Start fisherlens on this machine: migrate, build the zoo if missing, one worker, the app."""
    settings = get_settings()
    host = host or settings.host
    port = port or settings.port
    from app.auth import check_bind

    check_bind(host, settings)  # before the zoo build and the worker: refuse an open server early
    # Without PUBLIC_URL, share links follow the address each browser used (app.services.share_url).
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = settings.public_url if "PUBLIC_URL" in os.environ else f"http://{shown}:{port}"
    from storage.db import upgrade

    upgrade(settings.db_url)
    click.echo(f"database: {_safe_url(settings.db_url)}")
    click.echo(f"queue: {settings.redis_url or f'filesystem {settings.queue_dir}'}")
    _ensure_zoo(settings.zoo_dir)
    # the embedded worker calibrates its own device at start (compute/worker/device.py); a web
    # without one calibrates this machine for the estimates made before any worker is seen
    calibrating = _calibrate_in_background(settings) if no_worker else None
    supervisor = (
        None if no_worker else WorkerSupervisor(f"embedded-{os.getpid()}@{socket.gethostname()}")
    )

    # SIGTERM and Ctrl-C stop `up` by raising KeyboardInterrupt in the main thread. Python runs a
    # signal handler between any two bytecodes, also inside a finalizer (an event loop's __del__),
    # where the exception is printed and dropped, and `up` kept serving (seen under load, CI).
    # So the first signal also starts a thread that interrupts the main thread again every 2 s
    # until the shutdown has begun.
    stop_requested, shutting_down = threading.Event(), threading.Event()

    def _redeliver() -> None:
        while not shutting_down.wait(2.0):
            _thread.interrupt_main()

    def _term(signum: int, frame: Any) -> None:
        if not stop_requested.is_set():
            stop_requested.set()
            threading.Thread(target=_redeliver, name="up-stop", daemon=True).start()
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _term)
    old_int = signal.signal(signal.SIGINT, _term)
    try:
        if supervisor is not None:
            supervisor.start()
        try:
            from app.web import serve
        except ImportError as exc:
            click.echo(
                f"the web app is not available yet ({exc}); the worker runs on its own. "
                "Submit jobs with `fisherlens submit`. Ctrl-C stops.",
                err=True,
            )
            if supervisor is not None:
                supervisor.wait()
            return
        click.echo(f"fisherlens is up: {url}  (Ctrl-C stops)")
        serve(host, port)
    except KeyboardInterrupt:
        pass
    finally:
        shutting_down.set()
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
        if supervisor is not None:
            supervisor.stop()
        if calibrating is not None and calibrating.poll() is None:
            calibrating.terminate()
        click.echo("fisherlens stopped")


def _ensure_zoo(zoo_dir: Any) -> None:
    """Build the shipped model zoo on first start (missing models only), with a progress line
    at most every 2 s."""
    from compute.contract.modelref import ZOO_NAMES

    if all((zoo_dir / n / "config.json").is_file() for n in ZOO_NAMES):
        return
    click.echo(f"building the model zoo in {zoo_dir} (first start only) ...")
    from compute.zoo import build_zoo

    last = [0.0]

    def show(fraction: float, message: str = "") -> None:
        if time.monotonic() - last[0] > 2.0 or fraction >= 1.0:
            last[0] = time.monotonic()
            click.echo(f"  zoo {fraction:4.0%} {message}")

    build_zoo(zoo_dir, progress=show, force=False)


class WorkerSupervisor:
    """`fisherlens up`'s embedded worker, restarted whenever it exits (killed, out of memory,
    crashed), with a growing pause (1 s .. 30 s) when it keeps dying at once. The name is fixed
    for the life of `up` (embedded-<up pid>@host), so the restarted worker re-queues the job its
    previous process was running as soon as it starts."""

    def __init__(self, name: str):
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="worker-supervisor", daemon=True)

    def _spawn(self) -> None:
        cmd = [sys.executable, "-m", "app.cli", "worker", "--name", self.name]
        with self._lock:
            if self._stopping.is_set():
                return
            self.proc = subprocess.Popen(cmd)
        word = "started" if self.restarts == 0 else f"restarted (restart {self.restarts})"
        click.echo(f"worker {word} (pid {self.proc.pid})")

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _watch(self) -> None:
        pause = 0.5
        while not self._stopping.is_set():
            proc = self.proc
            assert proc is not None
            started = time.monotonic()
            code = proc.wait()
            if self._stopping.is_set():
                return
            pause = 0.5 if time.monotonic() - started > 60 else pause
            pause = min(30.0, pause * 2)
            click.echo(f"worker (pid {proc.pid}) exited with code {code}; restarting", err=True)
            if self._stopping.wait(pause):
                return
            self.restarts += 1
            self._spawn()

    def wait(self) -> None:
        while not self._stopping.is_set():
            time.sleep(1.0)

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc is not None:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM (Celery warm shutdown: the running job's message goes back to the queue), then
    SIGKILL if it does not exit in time; recovery on the next start re-queues its job."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@click.command("calibrate")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N")
@click.option("--dtype", default="float32", show_default=True,
              type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="where to write it [default: FISHERLENS_HOME/throughput.json, what estimates read]")
def calibrate_cmd(device: str, dtype: str, out: str | None) -> None:
    """Measure this machine's cost model (seconds = token-passes x (a + b x params)) from timed
    forward + backward passes of two random models; job estimates and time ceilings use it."""
    from compute.lm.calibrate import calibrate, write

    settings = get_settings()
    click.echo(f"timing forward + backward passes on {device} ({dtype}) ...")
    result = calibrate(device, dtype)
    path = write(Path(out) if out else settings.home / "throughput.json", result)
    for p in result["points"]:
        click.echo(f"  {p['params']:>12,} parameters: {p['seconds_per_token_pass'] * 1e6:.3g} us per token-pass")
    click.echo(f"a = {result['seconds_per_token_pass']:.3g} s per token-pass, b = "
               f"{result['seconds_per_param_token_pass']:.3g} s per parameter-token-pass "
               f"({result['device']}); wrote {path}")


def _calibrate_in_background(settings: Any) -> subprocess.Popen[bytes] | None:
    """`fisherlens calibrate` in a child process when this home has no calibration yet (the web
    process never imports torch; the estimates switch to it once the file appears)."""
    if (not settings.calibrate_on_up or (settings.home / "throughput.json").exists()
            or settings.throughput_file or settings.throughput):
        return None
    import sys

    click.echo("calibrating the cost model in the background (fisherlens calibrate) ...")
    return subprocess.Popen([sys.executable, "-m", "app.cli", "calibrate"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


commands: list[click.Command] = [
    calibrate_cmd,
    up_cmd,
    worker_cmd,
    submit_cmd,
    status_cmd,
    jobs_cmd,
    workers_cmd,
    cancel_cmd,
    rerun_cmd,
    db_group,
]
