"""The `fisher` job kind: the diagonal Fisher of a model on a task (compute/jobs/fisher_run.py).

Declares the spec, the typed result and its contract, the cost and `KIND`; figures and key numbers
are in app/figures/fisher.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from compute.contract.cost import (
    FISHER_BYTES_PER_PARAM,
    PRECISION_CHECK_MIN_TEMPORARIES_MB,
    Sizing,
    fisher_budget_bytes,
    fisher_memory,
    fisher_passes,
    fisher_seconds,
    fisher_temporaries,
)
from compute.contract.kinds import JobKind, KindForm, TensorView
from compute.contract.results import Contract, Row, Summary, TypedResult
from compute.contract.specs import (
    FisherKnobs,
    FisherPrompts,
    ModelRef,
    TaskRef,
    TopkPercent,
)

# ---------------------------------------------------------------- spec


class FisherSpec(FisherKnobs):
    # the estimator's knobs (prompts, samples, estimator, seed, sampling, dtype, device, memory
    # budget): compute.contract.specs.FisherKnobs
    model: ModelRef
    task: TaskRef = "arithmetic"
    shards: int = Field(1, ge=1, le=64, description="split the prompts over this many workers")
    topk_percent: TopkPercent = Field(1.0, description="top-k% used for split-half stability")
    exact_output: bool = Field(True, description="also compute the exact output-layer Fisher")
    until_reliable: bool = Field(
        False, description="when the split-half verdict is below 'fair' (top-k Jaccard < 0.5), add as many "
        "prompts again (doubling) until it is fair, up to max_prompts; the result records every round")
    max_prompts: FisherPrompts = Field(512, description="cap on the prompts until_reliable may reach")

    def more_samples(self) -> FisherSpec:
        """This spec, rerun with more samples: until_reliable on, and four times the prompts
        (capped at max_prompts, which grows to fit). What the explorer's "more samples" button and
        the API submit."""
        prompts = min(4096, self.prompts * 4)
        return FisherSpec.model_validate({**self.model_dump(), "prompts": prompts, "until_reliable": True,
                                          "max_prompts": max(self.max_prompts, prompts)})

    @model_validator(mode="after")
    def _shards_have_prompts(self) -> FisherSpec:
        if self.shards > self.prompts:
            raise ValueError(
                f"shards: got {self.shards}; accepted range: >= 1, <= prompts ({self.prompts}): "
                "every shard needs at least one prompt"
            )
        return self


# ---------------------------------------------------------------- result

FISHER_HEATMAPS = ("fisher/mean", "fisher/share")
CONCENTRATION = "concentration"


class ExactOutputRow(Row):
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
    gini_error_bound: float | None = None  # issue 30: the Gini of a streaming histogram, bracketed
    top0_1_share: float | None = Field(None, alias="top0.1%_share")
    top1_share: float | None = Field(None, alias="top1%_share")
    top10_share: float | None = Field(None, alias="top10%_share")
    split_half_jaccard: float | None = None
    split_half_topk_percent: float | None = None
    # issue 30: the halves as a float32 total + int16 difference: their stated rounding bound
    split_half_precision: dict[str, Any] | None = None
    # the per-sample temporaries budget the engine used (the spec's or its automatic one, MiB)
    memory_budget_mb: int | None = None
    exact_output: dict[str, ExactOutputRow] | None = None
    exact_output_skipped: str | None = None
    # issue 18: sums are float32; a half-precision forward/backward states its measured error
    accumulate_dtype: str | None = None
    precision_error: dict[str, Any] | None = None
    precision_error_skipped: str | None = None  # issue 30: no float32 copy of a model too large for it
    model_config = ConfigDict(populate_by_name=True)


class FisherResult(TypedResult[FisherSummary]):
    kind: Literal["fisher"]


CONTRACT = Contract("fisher", FisherResult, heatmaps=FISHER_HEATMAPS, series=(CONCENTRATION,),
                    groups=("tensor", "layer_module"))


# ---------------------------------------------------------------- the kind


def cost(s: FisherSpec) -> int:
    """until_reliable may double the prompts up to max_prompts: its cost is that worst case
    (the ceiling must hold for what the runner may do, not for the first round)."""
    prompts = max(s.prompts, s.max_prompts) if s.until_reliable else s.prompts
    return fisher_passes(prompts, s.samples, s.max_new_tokens, s.estimator, s.exact_output)


def _prompts(s: FisherSpec) -> int:
    return max(s.prompts, s.max_prompts) if s.until_reliable else s.prompts


def timing(s: FisherSpec, z: Sizing) -> dict[str, float]:
    """Load, sampling, the per-row gradients, the exact output-layer check and the statistics
    (compute.contract.cost.fisher_seconds), for until_reliable's worst case."""
    return {"load": z.load_s(), **fisher_seconds(z, _prompts(s), s.samples, s.max_new_tokens,
                                                 s.estimator, s.exact_output and not z.tied,
                                                 temperature=s.temperature)}


def memory(s: FisherSpec, z: Sizing) -> dict[str, float]:
    half = s.dtype in ("bfloat16", "float16") or (s.dtype == "auto" and s.device.startswith("cuda"))
    out = fisher_memory(z, _prompts(s), s.samples, s.max_new_tokens, s.memory_budget_mb,
                        2.0 if half else 4.0, estimator=s.estimator)
    # the float32 check of a half-precision Fisher (fisher_run.precision_check_plan): the model
    # widened in place (2 bytes/param) and two float32 sums on a CPU (one on a GPU, where the
    # Fisher's own sums have left the device), its temporaries from what the allowance leaves
    if half and s.estimator != "batch":
        n, cpu = z.params, not s.device.startswith("cuda")
        budget = fisher_budget_bytes(s.memory_budget_mb, z.free_bytes)
        fixed = (2.0 + (8.0 if cpu else 4.0)) * n
        temps = min(budget, (budget if cpu else FISHER_BYTES_PER_PARAM * n + budget) - fixed)
        if temps >= PRECISION_CHECK_MIN_TEMPORARIES_MB * 2**20:
            length = z.prompt_tokens + s.max_new_tokens
            check = (fixed - (0.0 if cpu else FISHER_BYTES_PER_PARAM * n)
                     + fisher_temporaries(z, min(16, _prompts(s) * s.samples), length, int(temps)))
            out["float32 check"] = max(0.0, check - out["temporaries"])
    return out


KIND = JobKind(
    name="fisher", title="Fisher", spec=FisherSpec, contract=CONTRACT, runner="compute.jobs.fisher_run:run",
    cost=cost, order=10, timing=timing, memory=memory,
    # the same Fisher with smaller per-sample temporaries (slower), or bf16 weights (its error
    # against float32 stated in the result)
    memory_options=({"memory_budget_mb": 256}, {"dtype": "bfloat16"}, {"dtype": "bfloat16", "memory_budget_mb": 256}),
    refs={"model": "model"},
    outputs={"fisher": "fisher"},
    form=KindForm(tab="Fisher", button="Compute Fisher",
                  main=("model", "task", "estimator", "prompts", "samples", "seed", "max_new_tokens",
                        "temperature", "exact_output")),
    example={"model": "arith-base", "prompts": 8, "samples": 2},
    tensors=TensorView(value="Fisher", artifact="fisher", config_field="model"),
)
