"""Cancel points and test-only fault points for long compute calls (stdlib only: no storage,
no celery, so every compute module may call them).

cancel_point(): called between sampling steps, forward chunks and around model loading. Outside a
`cancel_scope` it does nothing. Inside one (the worker opens it around each job) it calls the
scope's check, which reads the job's cancel flag (throttled) and raises
compute.contract.jobresult.JobCancelled, so a cancel takes effect within one chunk, not only between training
steps.

fault_point(name): the hook the fault-injection tests use to stop a worker at a named moment
(after_receive, after_claim, mid_job, during_fanout, loading, sampling,
artifact_uploaded: after a job's first object reaches the object store; constructing: while a
model's modules are being built). It is a no-op unless the
process runs with FISHERLENS_TESTING=1 *and* `name` is listed in FISHERLENS_FAULT_POINTS
(comma-separated) *and* FISHERLENS_FAULT_DIR is set. Only the environment of the worker process
turns it on: no job spec, API call or setting reaches it. When on, the first arrival at a point
creates FAULT_DIR/<name>.reached (exclusively: later arrivals pass through; atomically with its
text, publish_once) and blocks until the
test creates FAULT_DIR/<name>.release, or the process is killed. After a release the next
cancel_point checks at once (no throttle), so "cancel, then release" is deterministic.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# check(force) raises JobCancelled when the job should stop; force=True skips its throttle.
_check: contextvars.ContextVar[Callable[[bool], None] | None] = contextvars.ContextVar(
    "fisherlens_cancel_check", default=None
)
_force_next = contextvars.ContextVar("fisherlens_force_next_check", default=False)

FAULT_POINTS = ("after_receive", "after_claim", "mid_job", "during_fanout", "loading", "sampling",
                "artifact_uploaded", "constructing")


@contextmanager
def cancel_scope(check: Callable[[bool], None]) -> Iterator[None]:
    """Route cancel_point() calls in this context to `check(force)`."""
    token = _check.set(check)
    try:
        yield
    finally:
        _check.reset(token)


def cancel_point(force: bool = False) -> None:
    """Stop here if the running job was cancelled (no-op outside a cancel_scope)."""
    check = _check.get()
    if check is None:
        return
    if _force_next.get():
        _force_next.set(False)
        force = True
    check(force)


def _enabled(name: str) -> Path | None:
    if os.environ.get("FISHERLENS_TESTING") != "1":
        return None
    names = {n.strip() for n in os.environ.get("FISHERLENS_FAULT_POINTS", "").split(",")}
    folder = os.environ.get("FISHERLENS_FAULT_DIR")
    if name not in names or not folder:
        return None
    return Path(folder)


def publish_once(path: Path, text: str) -> bool:
    """Create `path` holding `text`, atomically and exclusively: False if it exists already.

    A reader that sees the file sees all of `text`: it is written to a private temporary file
    first and then hard-linked into place (link fails if the name exists, so exactly one caller
    wins). Creating the marker with O_EXCL and writing it afterwards left a window in which the
    marker existed but was empty: a test polling for it read "" and its `re.search(r"job=(\\d+)")`
    was None (the AttributeError of test_fanout_sweep on a loaded machine, issue 30)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    return True


def fault_point(name: str, detail: str = "") -> bool:
    """Block at `name` until released (tests only; see the module docstring). True if it
    blocked."""
    folder = _enabled(name)
    if folder is None:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    if not publish_once(folder / f"{name}.reached", f"pid={os.getpid()} {detail}\n"):
        return False  # one-shot: only the first arrival stops
    release = folder / f"{name}.release"
    while not release.exists():
        time.sleep(0.02)
    _force_next.set(True)
    return True
