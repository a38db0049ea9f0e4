"""What every job kind's typed result shares: the rows, the typed-result base, the contract shape.

A result is the dict of `compute.contract.jobresult.JobResult.to_dict()` (and of `GET /api/results/{token}`,
which adds "job" and "artifacts"): {"kind", "summary", "layer_stats", "heatmaps", "series"}.
Each kind declares, once, in compute/jobs/<kind>.py, a `Contract`:
- its summary fields (typed; the headline numbers readers show),
- the exact names of the heatmaps and series it produces, and the layer_stats groups.
Names are looked up exactly (`TypedResult.heatmap("fisher/mean")`), never by substring. Names
with a free part (a retention selector, a diff threshold) are a `Family`: an exact prefix, one
separator, the free part (`Family("retention").runs(result)` -> {"fisher": (xs, ys), ...}).

`check_against(contract, result_dict)` is what a runner must satisfy (JobResult.to_dict calls it
through compute.jobs.registry.check, so a compute change that breaks the contract fails its tests);
`parse_with(contract, dict)` is what readers call (by kind: compute.jobs.registry.parse_result). It
is lenient on keys it does not know (results stored by older code still parse) and strict on the
types of the keys it reads. No torch here: the web process imports this.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

Group = Literal["tensor", "layer_module"]
PRECISIONS = ("fp32", "bf16-mixed", "bf16")  # compute.contract.specs.PRECISION_DTYPES (a test checks)
Curve = tuple[list[float], list[float]]  # (xs sorted ascending, ys); points without a value left out


class ContractError(ValueError):
    """A result does not match its kind's schema (the message names the field)."""


@dataclass(frozen=True)
class Family:
    """Names `<prefix><sep><free part>`, e.g. "retention/fisher" (prefix "retention")."""

    prefix: str
    sep: str = "/"

    def part(self, name: str) -> str | None:
        """The free part of `name`, or None when the name is not in this family."""
        head = self.prefix + self.sep
        return name[len(head):] if name.startswith(head) and len(name) > len(head) else None


# ---------------------------------------------------------------- rows shared by every kind


class Row(BaseModel):
    """A stored row: frozen, strict types, unknown keys kept."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class LayerStatRow(Row):
    param: str = ""
    module: str = "other"
    layer: int | None = None
    values: dict[str, float | None] = Field(default_factory=dict)
    group: str = "tensor"


def _label(v: Any) -> Any:
    return f"{v:g}" if isinstance(v, float) else str(v) if isinstance(v, int) else v


Label = Annotated[str, BeforeValidator(_label)]  # axis labels are text; older results held numbers


class HeatmapData(Row):
    name: str
    x_labels: list[Label]
    y_labels: list[Label]
    z: list[list[float | None]]
    meta: dict[str, Any] = Field(default_factory=dict)


class SeriesPointData(Row):
    name: str
    step: float
    value: float | None = None


class Summary(Row):
    """Fields every kind may have; each kind's summary adds its own."""

    model: str | None = None
    task: str | None = None
    seconds: float | None = None
    settings: dict[str, Any] | None = None
    # issue 18 (precision and reliability travel with every result; move with the summaries):
    compute_dtype: str | None = None  # dtype the forward/backward (or arithmetic) ran in
    stored_dtype: str | None = None  # dtype of the stored tensors (artifact / checkpoint)
    fisher_reliability: dict[str, Any] | None = None  # the verdict of the Fisher a result used
    # where the job's time went, by the names of its kind's estimate (JobKind.timing), so a run's
    # estimate and its clock compare part by part (issue 30); a job of units (sweep, retention)
    # adds its units' parts, like `seconds`
    seconds_parts: dict[str, float] | None = None


def sum_parts(outputs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The units' `seconds_parts` added by name (first-seen order), in seconds to the millisecond."""
    total: dict[str, float] = {}
    for o in outputs:
        for k, v in (o.get("seconds_parts") or {}).items():
            total[k] = total.get(k, 0.0) + float(v)
    return {k: round(v, 3) for k, v in total.items()}


# ---------------------------------------------------------------- reliability (issue 18)
# Split-half top-k Jaccard: two independent halves of the samples should select the same top-k
# coordinates. >= 0.8: the top set is stable; 0.5..0.8: usable for aggregates (layer x module),
# not for single coordinates; < 0.5: the estimate is mostly sampling noise: take more samples.
RELIABLE_JACCARD = 0.8
FAIR_JACCARD = 0.5
LEVELS = ("none", "poor", "fair", "good")


def reliability_level(jaccard: float | None) -> str:
    """"good" | "fair" | "poor" from a split-half Jaccard; "none" without one."""
    if jaccard is None or jaccard != jaccard:  # None or NaN
        return "none"
    return "good" if jaccard >= RELIABLE_JACCARD else "fair" if jaccard >= FAIR_JACCARD else "poor"


# ---------------------------------------------------------------- the typed result

S = TypeVar("S", bound=Summary)


class TypedResult(BaseModel, Generic[S]):
    """A parsed result. `raw_summary` keeps every stored summary key (the summary table)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    kind: str
    summary: S
    layer_stats: list[LayerStatRow] = Field(default_factory=list)
    heatmaps: list[HeatmapData] = Field(default_factory=list)
    series: list[SeriesPointData] = Field(default_factory=list)
    raw_summary: dict[str, Any] = Field(default_factory=dict)
    job: dict[str, Any] | None = None
    artifacts: list[dict[str, Any]] = Field(default_factory=list)

    def heatmap(self, name: str) -> HeatmapData | None:
        return next((h for h in self.heatmaps if h.name == name), None)

    def heatmaps_in(self, family: Family) -> list[HeatmapData]:
        return [h for h in self.heatmaps if family.part(h.name) is not None]

    def stats(self, *groups: str) -> list[LayerStatRow]:
        return [r for r in self.layer_stats if r.group in groups]

    def curve(self, name: str) -> Curve | None:
        """The points of series `name`, sorted by step; None when it has none."""
        pts = sorted((p.step, p.value) for p in self.series if p.name == name and p.value is not None)
        return ([x for x, _ in pts], [y for _, y in pts]) if pts else None

    def curves(self, family: Family) -> dict[str, Curve]:
        """Free part -> curve, for every series of the family (in first-seen order)."""
        names = dict.fromkeys(p.name for p in self.series if family.part(p.name) is not None)
        out = {}
        for n in names:
            c = self.curve(n)
            if c is not None:
                out[str(family.part(n))] = c
        return out


# ---------------------------------------------------------------- what a kind produces


@dataclass(frozen=True)
class Contract:
    """What one kind produces: summary schema, exact names, name families, layer_stats groups."""

    kind: str
    result: type[TypedResult[Any]]
    heatmaps: tuple[str, ...] = ()
    heatmap_families: tuple[Family, ...] = ()
    series: tuple[str, ...] = ()
    series_families: tuple[Family, ...] = ()
    groups: tuple[str, ...] = ()

    def knows_heatmap(self, name: str) -> bool:
        return name in self.heatmaps or any(f.part(name) is not None for f in self.heatmap_families)

    def knows_series(self, name: str) -> bool:
        return name in self.series or any(f.part(name) is not None for f in self.series_families)

    def __post_init__(self) -> None:
        _DECLARED[self.kind] = self  # the kind module that declares it has been imported


# kind -> its Contract, filled as compute/jobs/<kind>.py modules declare theirs (a runner imports
# its kind's module for the spec, so a result is always checked against a declared contract).
# The registry (compute.jobs.registry) is the list of kinds; this is only the lookup the
# contract package can do without importing it.
_DECLARED: dict[str, Contract] = {}


def check_declared(result: Mapping[str, Any]) -> None:
    """check_against the declared contract of result["kind"]; ContractError when no kind module
    declared one."""
    kind = result.get("kind")
    c = _DECLARED.get(kind) if isinstance(kind, str) else None
    if c is None:
        raise ContractError(f"kind: no contract is declared for {kind!r} (compute/jobs/<kind>.py)")
    check_against(c, result)


def _names(items: Iterable[Any], key: str) -> list[str]:
    return [str(i.get(key) if isinstance(i, Mapping) else getattr(i, key)) for i in items]


def check_against(c: Contract, result: Mapping[str, Any]) -> None:
    """Raise ContractError unless every heatmap, series and group name is one the kind declares
    and the summary fields have their declared types."""
    for name in _names(result.get("heatmaps") or [], "name"):
        if not c.knows_heatmap(name):
            raise ContractError(f"heatmaps: {c.kind} result has heatmap {name!r}; declared: "
                                f"{', '.join(c.heatmaps + tuple(f.prefix + f.sep + '*' for f in c.heatmap_families))}")
    for name in dict.fromkeys(_names(result.get("series") or [], "name")):
        if not c.knows_series(name):
            raise ContractError(f"series: {c.kind} result has series {name!r}; declared: "
                                f"{', '.join(c.series + tuple(f.prefix + f.sep + '*' for f in c.series_families))}")
    for group in dict.fromkeys(_names(result.get("layer_stats") or [], "group")):
        if group not in c.groups:
            raise ContractError(f"layer_stats: {c.kind} result has group {group!r}; declared: "
                                f"{', '.join(c.groups) or 'none'}")
    parse_with(c, result)


def result_kind(result: Mapping[str, Any] | TypedResult[Any]) -> Any:
    """The kind of a result dict ("kind", else the job's) or typed result."""
    if isinstance(result, TypedResult):
        return result.kind
    return result.get("kind") or (result.get("job") or {}).get("kind")


def parse_with(c: Contract, result: Mapping[str, Any]) -> TypedResult[Any]:
    """The typed result of a result dict of kind `c.kind`. Unknown keys and names are kept or
    ignored; a known field of the wrong type is a ContractError naming it."""
    kind = c.kind
    summary = result.get("summary") or {}
    data = {"kind": kind, "summary": summary, "raw_summary": dict(summary),
            "layer_stats": result.get("layer_stats") or [], "heatmaps": result.get("heatmaps") or [],
            "series": result.get("series") or [], "job": result.get("job"),
            "artifacts": result.get("artifacts") or []}
    try:
        return c.result.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ContractError(f"{where}: {err['msg']} (got {err.get('input')!r:.80}) in a {kind} "
                            "result") from None
