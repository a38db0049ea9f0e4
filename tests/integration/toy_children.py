"""A toy job module implementing compute/jobs/runners.py's child protocol over SweepSpec (one child
per learning rate), so the worker's generic fan-out is tested without training anything.
test_fanout.py points RUNNERS["sweep"] here. Seed 13 makes child 1 fail."""

from __future__ import annotations

from typing import Any

import torch

from compute.contract.jobresult import JobResult, null_progress


def children(spec: Any) -> int:
    return len(spec.lrs)


def run_child(spec: Any, index: int, progress: Any = null_progress, refs: Any = None) -> dict[str, Any]:
    progress(0.5, f"lr {spec.lrs[index]}")
    if spec.seed == 13 and index == 1:
        raise ValueError(f"lrs: {spec.lrs[index]} diverged")
    model = refs["model"].where() if refs else None  # the worker hands every child the parent's refs
    return {"index": index, "lr": spec.lrs[index], "w": torch.full((2,), float(index)), "model": model}


def combine(spec: Any, outputs: list[dict[str, Any]], progress: Any = null_progress,
            refs: Any = None) -> JobResult:
    progress(0.99, "combining")
    return JobResult(
        kind="sweep",
        summary={"indices": [o["index"] for o in outputs], "lrs": [o["lr"] for o in outputs],
                 "w_sum": float(sum(o["w"].sum() for o in outputs)),
                 "models": sorted({str(o.get("model")) for o in outputs})},
    )


def run(spec: Any, progress: Any = null_progress, refs: Any = None) -> JobResult:
    return combine(spec, [run_child(spec, i, progress) for i in range(children(spec))], progress)
