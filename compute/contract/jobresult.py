"""What every job returns: small rows for the database, full tensors for artifacts.

Pure data (no torch import at module level): the web process reads the same shapes back from
the database as plain dicts (see `JobResult.to_dict`); readers parse them with
`compute.jobs.registry.parse_result`, whose per-kind contracts `to_dict` enforces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class LayerStat:
    """One row of per-layer statistics. `layer` is None for non-layer params (embeddings, final norm)."""

    param: str  # parameter name, or "" for an aggregate row
    module: str  # module type: q, k, v, o, gate, up, down, norm, embed, lm_head, other
    layer: int | None
    values: dict[str, float]  # e.g. {"mean": .., "max": .., "mass": .., "share": ..}
    group: str = "tensor"  # "tensor" (one parameter) or "layer_module" (aggregate) or any other key


@dataclass
class Heatmap:
    """A matrix with axis labels. z[i][j] is for y_labels[i], x_labels[j]."""

    name: str
    x_labels: list[str]
    y_labels: list[str]
    z: list[list[float | None]]
    meta: dict[str, Any] = field(default_factory=dict)  # units, colour scale hints, hover text


@dataclass
class SeriesPoint:
    name: str  # e.g. "reward/full", "concentration"
    step: float  # x value (a step, or a fraction for curves)
    value: float


@dataclass
class JobResult:
    """Returned by every `compute.jobs.<kind>_run.run(spec, progress, refs)`.

    summary: JSON-able dict of headline numbers and settings (what the result used).
    tensors: artifact kind -> {name: tensor}; saved as one safetensors file per kind.
    files: extra artifact files (kind -> path on disk) such as a trained HF model folder.
    """

    kind: str
    summary: dict[str, Any]
    layer_stats: list[LayerStat] = field(default_factory=list)
    heatmaps: list[Heatmap] = field(default_factory=list)
    series: list[SeriesPoint] = field(default_factory=list)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    # artifact kind -> safetensors metadata of that file (e.g. a Fisher's reliability; issue 18)
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The same JSON shape that `GET /api/results/{token}` returns (minus job metadata).

        Checked against the kind's contract (compute/jobs/<kind>.py): a heatmap, series or
        layer_stats group the kind does not declare, or a summary field of the wrong type, raises
        ContractError naming it."""
        from compute.contract.results import check_declared

        out = {
            "kind": self.kind,
            "summary": self.summary,
            "layer_stats": [s.__dict__ for s in self.layer_stats],
            "heatmaps": [h.__dict__ for h in self.heatmaps],
            "series": [p.__dict__ for p in self.series],
        }
        check_declared(out)
        return out


class Progress(Protocol):
    """What a job reports progress to: progress(fraction in [0,1], message), both positional.
    Any function of that shape is one (a lambda, null_progress, the worker's JobProgress). It
    may raise JobCancelled to stop the job."""

    def __call__(self, fraction: float, message: str, /) -> None: ...


class JobCancelled(Exception):
    """Raised from a progress callback when the user cancelled the job."""


def null_progress(fraction: float, message: str = "") -> None:
    return None
