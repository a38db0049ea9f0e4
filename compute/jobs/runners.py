"""Job kind -> pure compute entry points, imported lazily (the web process never imports torch).

Every kind's runner module (`KIND.runner` in compute/jobs/<kind>.py) has the entry point

    run(spec, progress, refs=None) -> JobResult

where `spec` is the kind's pydantic spec (`KIND.spec`), `progress(fraction, message)`
reports a fraction in [0, 1] and may raise `JobCancelled` (the user cancelled), and JobResult is
the kind's typed result. `run` does the whole job in this process: the CLI's direct commands
call it, and so does the worker when a job has no child units.

`refs` ({field: Ref}, compute.contract.kinds) are the spec's references (model, teacher, base,
tuned, fisher, mask, gradient), resolved once at validation by app.services.refs (owners
checked there) and made local by the caller: the worker fetches them from the job row
(compute.worker.refs: sha256 re-verified), the CLI resolves them as its user. A runner reads
`refs[field].where()` (compute.jobs.artifact_files.resolved_refs, load_model, open_checkpoint accept a Ref) and
never resolves a reference itself; the spec keeps what the user wrote (results show `job:3`, not
a server path). refs=None is for library callers (tests, notebooks): each field is then named
directly (a zoo name, an allowed folder, a hub id, a file path; never job:N). The worker and
the CLI always pass `refs=` as a keyword, to `run`, `run_child` and `combine` alike.

Child units (fan-out over the workers)
--------------------------------------
A kind's module MAY also define all three of these functions (all or none; `child_protocol`
raises if only some are there):

    def children(spec) -> int
        How many independent child units this spec splits into when it is queued. Called in the
        worker with the parsed spec and nothing else (no model load: keep it cheap and pure).
        <= 1 means "run inline": the worker calls `run(spec, progress)` as for any kind.

    def run_child(spec, index, progress, refs=None) -> Any
        Compute unit `index` (0 <= index < children(spec)) of the *parent's* spec, in its own
        worker process. Returns plain data that `torch.save` writes and
        `torch.load(weights_only=True)` reads back: dicts, lists, tuples of tensors, str, int,
        float, bool, None (no dataclasses, no numpy arrays, no custom classes). The result must
        depend only on (spec, index) -- e.g. per-unit seeds -- so a retried child gives the same
        output. `progress` reports the child's own fraction in [0, 1]; the parent shows the
        mean over its children.

    def combine(spec, outputs, progress, refs=None) -> JobResult
        The parent's result from every child's output, `outputs[i]` being run_child(spec, i)
        (index order, all present). Runs once, in one worker, after every child succeeded.
        `progress` is the parent's.

What the worker (compute/worker) guarantees when children(spec) > 1:
- child job rows 0..n-1 (parent_id = the parent's id, shard_index = index, the parent's kind,
  spec and owner) are created in one transaction, each queued as its own Celery message, so
  n workers run n children at once; a re-delivery reuses the rows;
- each child's output is stored as the child's artifact (kind "shard", file shard.pt);
- the parent is combined exactly once (a compare-and-set in storage: storage.jobs
  request_combine / claim_combine), when all n children succeeded;
- cancelling the parent cancels its children (queued ones at once, running ones at their next
  progress call or cancel point); a child that fails or is cancelled fails the parent with a
  message naming the child ("child 3 failed: ..."); a child whose worker dies is re-run like
  any job (its attempts count), and fails the parent when it gives up.
`run(spec, progress, refs)` should give the same result as combine(spec, [run_child(spec, i) ...]):
the CLI runs inline, the worker fans out, and the numbers must not depend on which.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compute.jobs.registry import KINDS

# kind -> "module:function", read from the registry (tests point an entry at a toy runner)
RUNNERS: dict[str, str] = {k.name: k.runner for k in KINDS.values()}

CHILD_FUNCTIONS = ("children", "run_child", "combine")


def _module(kind: str) -> Any:
    if kind not in RUNNERS:
        raise ValueError(f"kind: unknown job kind {kind!r}; accepted: {', '.join(RUNNERS)}")
    return importlib.import_module(RUNNERS[kind].split(":")[0])


def get_runner(kind: str) -> Callable[..., Any]:
    """The kind's `run(spec, progress, refs=None) -> JobResult`."""
    return getattr(_module(kind), RUNNERS[kind].split(":")[1])


@dataclass(frozen=True)
class ChildProtocol:
    """A kind's child-unit functions (see the module docstring)."""

    children: Callable[[Any], int]
    run_child: Callable[..., Any]  # (spec, index, progress, refs=None)
    combine: Callable[..., Any]  # (spec, outputs, progress, refs=None)


def child_protocol(kind: str) -> ChildProtocol | None:
    """The kind's children/run_child/combine, or None when its module defines none of them."""
    module = _module(kind)
    found = {name: getattr(module, name, None) for name in CHILD_FUNCTIONS}
    if all(f is None for f in found.values()):
        return None
    missing = [name for name, f in found.items() if not callable(f)]
    if missing:
        raise TypeError(
            f"kind {kind!r}: {module.__name__} defines only part of the child protocol; "
            f"missing {', '.join(missing)} (define all of {', '.join(CHILD_FUNCTIONS)} or none)"
        )
    return ChildProtocol(module.children, module.run_child, module.combine)


def child_count(kind: str, spec: Any) -> int:
    """How many child units `spec` fans out into when queued (0 or 1: it runs inline)."""
    protocol = child_protocol(kind)
    return int(protocol.children(spec)) if protocol is not None else 0


def dump_output(output: Any) -> bytes:
    """A child's output as the worker ships it to its parent (torch.save bytes)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(output, buf)
    return buf.getvalue()


def load_output(blob: bytes) -> Any:
    """dump_output's bytes back, weights-only (plain python and tensors; no pickled code)."""
    import io

    import torch

    return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
