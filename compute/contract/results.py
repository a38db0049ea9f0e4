"""One typed result schema per job kind: the contract between compute and every reader.

A result is the dict of `compute.contract.jobresult.JobResult.to_dict()` (and of `GET /api/results/{token}`,
which adds "job" and "artifacts"): {"kind", "summary", "layer_stats", "heatmaps", "series"}.
Each kind declares here, once:
- its summary fields (typed; the headline numbers readers show),
- the exact names of the heatmaps and series it produces, and the layer_stats groups.
Names are looked up exactly (`TypedResult.heatmap("fisher/mean")`), never by substring. Names
with a free part (a retention selector, a diff threshold) are a `Family`: an exact prefix, one
separator, the free part (`Family("retention").runs(result)` -> {"fisher": (xs, ys), ...}).

`check(result_dict)` is what a runner must satisfy (JobResult.to_dict calls it, so a compute
change that breaks the contract fails its tests); `parse_result(dict)` is what readers call. It is
lenient on keys it does not know (results stored by older code still parse) and strict on the
types of the keys it reads. No torch here: the web process imports this.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

Kind = Literal["fisher", "mask", "train", "sweep", "retention", "diff", "tokens"]
KINDS: tuple[str, ...] = ("fisher", "mask", "train", "sweep", "retention", "diff", "tokens")
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


class _Row(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class LayerStatRow(_Row):
    param: str = ""
    module: str = "other"
    layer: int | None = None
    values: dict[str, float | None] = Field(default_factory=dict)
    group: str = "tensor"


def _label(v: Any) -> Any:
    return f"{v:g}" if isinstance(v, float) else str(v) if isinstance(v, int) else v


Label = Annotated[str, BeforeValidator(_label)]  # axis labels are text; older results held numbers


class HeatmapData(_Row):
    name: str
    x_labels: list[Label]
    y_labels: list[Label]
    z: list[list[float | None]]
    meta: dict[str, Any] = Field(default_factory=dict)


class SeriesPointData(_Row):
    name: str
    step: float
    value: float | None = None


class Summary(_Row):
    """Fields every kind may have; each kind's summary adds its own."""

    model: str | None = None
    task: str | None = None
    seconds: float | None = None
    settings: dict[str, Any] | None = None
    # issue 18 (precision and reliability travel with every result; move with the summaries):
    compute_dtype: str | None = None  # dtype the forward/backward (or arithmetic) ran in
    stored_dtype: str | None = None  # dtype of the stored tensors (artifact / checkpoint)
    fisher_reliability: dict[str, Any] | None = None  # the verdict of the Fisher a result used


# ---------------------------------------------------------------- per-kind summaries


class ExactOutputRow(_Row):
    relative_l1_error: float | None = None
    mc_mass: float | None = None
    exact_mass: float | None = None


class FisherSummary(Summary):
    estimator: str | None = None
    n_samples: int | None = None
    n_rows: int | None = None
    n_tokens: int | None = None
    n_params: int | None = None
    total_mass: float | None = None
    gini: float | None = None
    top0_1_share: float | None = Field(None, alias="top0.1%_share")
    top1_share: float | None = Field(None, alias="top1%_share")
    top10_share: float | None = Field(None, alias="top10%_share")
    split_half_jaccard: float | None = None
    split_half_topk_percent: float | None = None
    exact_output: dict[str, ExactOutputRow] | None = None
    exact_output_skipped: str | None = None
    # issue 18: sums are float32; a half-precision forward/backward states its measured error
    accumulate_dtype: str | None = None
    precision_error: dict[str, Any] | None = None
    model_config = ConfigDict(populate_by_name=True)


class MaskSummary(Summary):
    select: str | None = None
    density_requested: float | None = None
    density: float | None = None
    kept: int | None = None
    total: int | None = None
    fisher: str | None = None
    fisher_mass_kept: float | None = None
    by_module: dict[str, float | None] | None = None
    by_layer: dict[str, float | None] | None = None
    overlap_with_fisher_topk: dict[str, float | None] | None = None


class TrainSummary(Summary):
    algo: str | None = None
    precision: str | None = None
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    accuracy_gain: float | None = None
    reward_first: float | None = None
    reward_last: float | None = None
    trainable_fraction: float | None = None
    eval: dict[str, Any] | None = None
    update_sparsity: dict[str, Any] | None = None
    bound: dict[str, Any] | None = None
    concentration: dict[str, Any] | None = None


class SweepPoint(_Row):
    lr: float
    optimizer: str
    precision: str
    unchanged_bf16: float | None = None
    unchanged_exact: float | None = None
    fisher_auc_changed: float | None = None
    fisher_auc_changed_within_binades: float | None = None
    fisher_auc_gradient: float | None = None
    fisher_auc_changed_by_binade: list[dict[str, Any]] | None = None
    reward_before: float | None = None
    reward_after: float | None = None


class SweepSummary(Summary):
    algo: str | None = None
    points: list[SweepPoint] = Field(default_factory=list)
    markdown: str | None = None


class RetentionRow(_Row):
    selector: str
    density: float | None = None
    reward_mean: float | None = None
    reward_std: float | None = None
    reward_ci: list[float | None] | None = None
    retention: float | None = None
    retention_ci: list[float | None] | None = None
    retention_mean: float | None = None
    retention_std: float | None = None
    retention_of_means: float | None = None
    retentions: list[float | None] | None = None


class RetentionSummary(Summary):
    algo: str | None = None
    base_reward: float | None = None
    base_se: float | None = None
    full_reward_mean: float | None = None
    full_reward_std: float | None = None
    full_se: float | None = None
    full_rewards: list[float | None] | None = None
    retention_valid: bool | None = None
    warning: str | None = None
    confidence: float | None = None
    rows: list[RetentionRow] = Field(default_factory=list)


class DiffSummary(Summary):
    base: str | None = None
    tuned: str | None = None
    n_params: int | None = None
    unchanged_exact: float | None = None
    changed_fraction: float | None = None
    # issue 18: the headline "unchanged" in the convention the stored dtypes call for
    update_sparsity: float | None = None
    unchanged_common: float | None = None
    stored_dtypes: dict[str, str] | None = None
    comparison_dtype: str | None = None
    comparison: str | None = None
    fisher: str | None = None
    auc: float | None = None
    changed_auc: float | None = None
    precision_at_k: float | None = None
    jaccard: float | None = None
    jaccard_random: float | None = None
    spearman: float | None = None
    overlap: list[dict[str, Any]] | None = None
    overlap_settings: dict[str, Any] | None = None

    def unchanged(self) -> dict[str, float]:
        """Threshold label -> unchanged fraction, from the "unchanged_<label>" fields in order."""
        out = {}
        for k, v in self.model_dump().items():  # declared fields and extra keys, stored order
            lab = UNCHANGED.part(k)
            if lab is not None and isinstance(v, int | float) and not isinstance(v, bool):
                out[lab] = float(v)
        return out


class TokenRow(_Row):
    token: str = ""
    id: int | None = None
    prob: float | None = None
    share: float | None = None
    contrib: float | None = None


class TokensSummary(Summary):
    context: str | None = None
    entropy: float | None = None
    scope: str | None = None
    top_tokens: list[TokenRow] = Field(default_factory=list)
    random_tokens: list[TokenRow] = Field(default_factory=list)
    low_tokens: list[TokenRow] = Field(default_factory=list)
    fisher_trace: float | None = None
    fisher_exact: bool | None = None
    similarity: dict[str, Any] | None = None


UNCHANGED = Family("unchanged", "_")  # diff summary keys unchanged_<threshold label>

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


class FisherResult(TypedResult[FisherSummary]):
    kind: Literal["fisher"]


class MaskResult(TypedResult[MaskSummary]):
    kind: Literal["mask"]


class TrainResult(TypedResult[TrainSummary]):
    kind: Literal["train"]


class SweepResult(TypedResult[SweepSummary]):
    kind: Literal["sweep"]


class RetentionResult(TypedResult[RetentionSummary]):
    kind: Literal["retention"]


class DiffResult(TypedResult[DiffSummary]):
    kind: Literal["diff"]


class TokensResult(TypedResult[TokensSummary]):
    kind: Literal["tokens"]


# ---------------------------------------------------------------- names each kind produces

TRAIN_METRICS = ("reward", "loss", "accuracy", "reverse_kl", "kl", "grad_norm")
CONCENTRATION_TARGETS = ("grad_sq_sum", "grad_abs_sum", "abs_delta")
SWEEP_METRICS = ("unchanged_bf16", "fisher_auc_changed", "fisher_auc_gradient")
SWEEP_SERIES = ("unchanged_bf16", "unchanged_exact", "fisher_auc_changed", "fisher_auc_gradient")
OVERLAP_METRICS = ("jaccard_lift", "auc", "precision_at_k")
TOKEN_SETS = ("top", "random", "low")


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


FISHER_HEATMAPS = ("fisher/mean", "fisher/share")
CONCENTRATION = "concentration"
BOUND_POINTS, BOUND_RHS = "bound/|grad|", "bound/rhs"
EVAL_ACCURACY = "eval/accuracy"
TRAIN = Family("train")
BOUND_HIST = "bound_log_hist"
CONCENTRATION_AUC = tuple(f"concentration_auc_{t}" for t in CONCENTRATION_TARGETS)
SWEEP_HEATMAPS = tuple(f"sweep_{m}_{p}" for m in SWEEP_METRICS for p in PRECISIONS)
SWEEP = {m: Family(f"sweep/{m}") for m in SWEEP_SERIES}  # sweep/<metric>/<optimizer> <precision>
RETENTION, HELDOUT, TRAIN_REWARD = Family("retention"), Family("heldout"), Family("train_reward")
UPDATE_SPARSITY = Family("update_sparsity", "_")  # update_sparsity_<threshold label>
FISHER_VS_DELTA = tuple(f"fisher_vs_delta_{m}" for m in OVERLAP_METRICS)
THRESHOLD_PROFILE = "threshold_profile"
UNCHANGED_SERIES = ("unchanged/atol", "unchanged/atol_bf16delta", "unchanged/rel_rms")
SIMILARITY = {w: f"similarity_{w}" for w in TOKEN_SETS}

CONTRACTS: dict[str, Contract] = {c.kind: c for c in (
    Contract("fisher", FisherResult, heatmaps=FISHER_HEATMAPS, series=(CONCENTRATION,),
             groups=("tensor", "layer_module")),
    Contract("mask", MaskResult, heatmaps=("mask_density",), groups=("tensor",)),
    Contract("train", TrainResult, heatmaps=(BOUND_HIST, *CONCENTRATION_AUC),
             series=(*(f"train/{m}" for m in TRAIN_METRICS), EVAL_ACCURACY, BOUND_POINTS, BOUND_RHS)),
    Contract("sweep", SweepResult, heatmaps=SWEEP_HEATMAPS, series_families=tuple(SWEEP.values())),
    Contract("retention", RetentionResult, heatmaps=("retention",),
             series_families=(RETENTION, HELDOUT, TRAIN_REWARD)),
    Contract("diff", DiffResult, heatmaps=(*FISHER_VS_DELTA, THRESHOLD_PROFILE),
             heatmap_families=(UPDATE_SPARSITY,), series=UNCHANGED_SERIES,
             groups=("tensor", "layer_module")),
    Contract("tokens", TokensResult, heatmaps=tuple(SIMILARITY.values()), groups=("tensor",)),
)}


def contract(kind: Any) -> Contract:
    if kind not in CONTRACTS:
        raise ContractError(f"kind: got {kind!r}; accepted: {', '.join(KINDS)}")
    return CONTRACTS[kind]


def _names(items: Iterable[Any], key: str) -> list[str]:
    return [str(i.get(key) if isinstance(i, Mapping) else getattr(i, key)) for i in items]


def check(result: Mapping[str, Any]) -> None:
    """Raise ContractError unless every heatmap, series and group name is one the kind declares
    and the summary fields have their declared types."""
    c = contract(result.get("kind"))
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
    parse_result(result)


def parse_result(result: Mapping[str, Any] | TypedResult[Any]) -> TypedResult[Any]:
    """The typed result of a result dict (kind from "kind", else from "job"). Unknown keys and
    names are kept or ignored; a known field of the wrong type is a ContractError naming it."""
    if isinstance(result, TypedResult):
        return result
    kind = result.get("kind") or (result.get("job") or {}).get("kind")
    c = contract(kind)
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
