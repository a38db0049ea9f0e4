"""The `diff` job kind: which weights a fine-tune changed, against the Fisher (compute/jobs/diff_run.py).

Declares the spec, the typed result and its contract, the cost and `KIND`; figures and key numbers
are in app/figures/diff.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from compute.contract.cost import (
    CHECKPOINT_CALLS_PER_PARAM,
    CHECKPOINT_CALLS_PER_TENSOR,
    DIFF_BYTES_PER_LARGEST,
    DIFF_SPECTRA_MB,
    FILE_JOB_BASE_MB,
    FILE_JOB_CALLS,
    MIB,
    SVD_MAX_NUMEL,
    Sizing,
)
from compute.contract.kinds import JobKind, KindForm, TensorView
from compute.contract.results import Contract, Family, Summary, TypedResult
from compute.contract.specs import (
    AllowOtherModel,
    ModelRef,
    Spec,
    TopkPercent,
)

UNCHANGED = Family("unchanged", "_")  # summary keys unchanged_<threshold label>

# ---------------------------------------------------------------- spec


class DiffSpec(Spec):
    base: ModelRef
    tuned: ModelRef
    fisher: str | None = Field(None, max_length=1000, description="fisher.safetensors path or 'job:<id>'")
    allow_other_model: AllowOtherModel = False
    topk_percent: TopkPercent = Field(1.0,
        description="top-k% used for the Fisher/|delta| overlap")
    store_delta: bool = Field(False, description="also store the full float32 delta as an artifact (large)")
    svd_max_numel: int = Field(
        SVD_MAX_NUMEL, ge=0, le=10_000_000_000, description="skip rank/SVD of 2-D deltas above this size"
    )


# ---------------------------------------------------------------- result

OVERLAP_METRICS = ("jaccard_lift", "auc", "precision_at_k")
UPDATE_SPARSITY = Family("update_sparsity", "_")  # update_sparsity_<threshold label>
FISHER_VS_DELTA = tuple(f"fisher_vs_delta_{m}" for m in OVERLAP_METRICS)
THRESHOLD_PROFILE = "threshold_profile"
UNCHANGED_SERIES = ("unchanged/atol", "unchanged/atol_bf16delta", "unchanged/rel_rms")


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


class DiffResult(TypedResult[DiffSummary]):
    kind: Literal["diff"]


CONTRACT = Contract("diff", DiffResult, heatmaps=(*FISHER_VS_DELTA, THRESHOLD_PROFILE),
                    heatmap_families=(UPDATE_SPARSITY,), series=UNCHANGED_SERIES,
                    groups=("tensor", "layer_module"))


# ---------------------------------------------------------------- the kind


def cost(s: DiffSpec) -> int:
    return 0  # reads two checkpoints, no forward passes (app/limits.py charges one pass over the weights)


def timing(s: DiffSpec, z: Sizing) -> dict[str, float]:
    """Opening both checkpoints and comparing them tensor by tensor (the rank of 2-D deltas
    included), with the Fisher when given."""
    tensors = 9 * max(z.layers, 1) + 2  # a decoder's weights and norms (its matrices: Sizing.matrices)
    return {"open": z.calls_s(FILE_JOB_CALLS),
            "compare": z.calls_s(CHECKPOINT_CALLS_PER_TENSOR * tensors + 2 * CHECKPOINT_CALLS_PER_PARAM * z.params),
            "spectra": z.svd_s(s.svd_max_numel)}


def memory(s: DiffSpec, z: Sizing) -> dict[str, float]:
    """The two checkpoints are read tensor by tensor (no model is built): the largest tensor's
    two sides and its chunked temporaries at a time; with a Fisher, every tensor's |delta|, base
    weights and Fisher held for the overlap (12 bytes/param), with store_delta every float32
    delta. It counted 12 bytes/param always: 1.55 GB for SmolLM2-135M's diff, which peaked at
    184 MiB (bench_estimates.json, session 19)."""
    out = {"runtime": FILE_JOB_BASE_MB * MIB, "largest tensor": DIFF_BYTES_PER_LARGEST * z.largest_tensor(),
           "spectra": DIFF_SPECTRA_MB * MIB}
    if s.fisher:
        out["held for the Fisher overlap"] = 12.0 * z.params
    if s.store_delta:
        out["stored delta"] = 4.0 * z.params
    return out


KIND = JobKind(
    name="diff", title="Checkpoint diff", spec=DiffSpec, contract=CONTRACT, runner="compute.jobs.diff_run:run",
    cost=cost, order=60, timing=timing, memory=memory,
    refs={"base": "model", "tuned": "model", "fisher": "fisher"},
    form=KindForm(tab="Checkpoint diff", button="Diff", cost=False,
                  main=("base", "tuned", "fisher", "topk_percent")),
    cli_args=("base", "tuned"),
    example={"base": "arith-base", "tuned": "job:2"},
    tensors=TensorView(value="|delta|", artifact="delta", absolute=True, pair=("base", "tuned"), config_field="base",
                       fisher_field="fisher", k_fields=("topk_percent",)),
)
