"""Job kind -> pure compute entry point, imported lazily (the web process never imports torch).

Each entry point is `run(spec, progress) -> compute.results.JobResult`, where `spec` is the
matching pydantic model of `compute.specs` and `progress(fraction, message)` may raise
`compute.results.JobCancelled`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

RUNNERS: dict[str, str] = {
    "fisher": "compute.run_fisher:run",
    "mask": "compute.run_mask:run",
    "train": "compute.run_train:run",
    "sweep": "compute.run_sweep:run",
    "retention": "compute.run_retention:run",
    "diff": "compute.run_diff:run",
    "tokens": "compute.run_tokens:run",
}


def get_runner(kind: str) -> Callable[..., Any]:
    if kind not in RUNNERS:
        raise ValueError(f"kind: unknown job kind {kind!r}; accepted: {', '.join(RUNNERS)}")
    module, func = RUNNERS[kind].split(":")
    return getattr(importlib.import_module(module), func)
