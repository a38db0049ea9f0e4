"""The `retention` job kind: masked training at several densities and selectors against full
training and the base, with confidence intervals (compute/jobs/retention_run.py, compute/studies/retention.py).

Declares the spec, the typed result and its contract, the cost and `KIND`; figures and key numbers
are in app/figures/retention.py.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from compute.contract.cost import (
    MASK_CALLS_PER_ELEMENT,
    MASK_SELECT_CALLS,
    MIB,
    RETENTION_STATE_MB,
    Sizing,
    fisher_passes,
    fisher_seconds,
    train_finish_seconds,
    train_host_memory,
    train_memory,
    train_passes,
    train_seconds,
)
from compute.contract.kinds import JobKind, KindForm
from compute.contract.results import Contract, Family, Row, Summary, TypedResult
from compute.contract.specs import (
    Batch,
    Dtype,
    FisherPrompts,
    Group,
    Lr,
    MaxNewTokens,
    ModelRef,
    Optimizer,
    Selector,
    Steps,
    TrainingKnobs,
)

# Retention's OPD teacher when none is given (compute/jobs/retention_run.py uses this table).
DEFAULT_TEACHERS = {"arith-base": "arith-teacher"}

# ---------------------------------------------------------------- spec


def _nullable(schema: dict[str, Any]) -> None:
    """The JSON schema of a field that null also fills (with its computed default): the API's
    schema then says what the validator accepts (schemathesis checks both ways)."""
    kept = {k: schema.pop(k) for k in ("type", "minimum", "maximum") if k in schema}
    schema["anyOf"] = [kept, {"type": "null"}]


class RetentionSpec(TrainingKnobs):
    """Defaults tuned on arith-base (GRPO, 100 steps: held-out greedy accuracy ~0.27 -> ~0.4) so the
    default grid runs in minutes on 2 CPU cores; statistics in compute.studies.retention."""

    # shared knobs (momentum, temperature, kl_coef, ...): compute.contract.specs.TrainingKnobs;
    # redeclared here where retention's default or description differs
    model: ModelRef = Field("arith-base", description="zoo name, local HF dir, hub id org/name, or job:N")
    teacher: ModelRef | None = Field(None,
        description="teacher for opd (default: arith-teacher for arith-base)")
    batch: Batch = Field(16, description="prompts per step")
    group: Group = Field(8, description="completions sampled per prompt")
    max_new_tokens: MaxNewTokens = Field(6, description="sampled completion length")
    eval_prompts: int = Field(
        2500, ge=2, le=100_000, description="held-out prompts (the same for every model); when not "
        "given (or null): ceil(0.25 / eval_se^2), so every model's mean reward has standard error "
        "<= eval_se", json_schema_extra=lambda s: _nullable(s))
    fisher_prompts: FisherPrompts = Field(64, description="prompts of the initial Fisher")
    densities: list[Annotated[float, Field(gt=0.0, le=1.0)]] = Field(
        default_factory=lambda: [0.01, 0.05, 0.1], min_length=1, max_length=16, description="mask densities"
    )
    selectors: list[Selector] = Field(
        description="mask selectors",
        default_factory=lambda: list[Selector](["fisher", "random", "magnitude"]), min_length=1, max_length=8
    )
    seeds: int = Field(3, ge=1, le=16, description="paired seeds: each runs full training and every mask")
    steps: Steps = Field(100, description="optimizer steps per run")
    lr: Lr = Field(2e-4, description="learning rate")
    optimizer: Optimizer = Field("adamw", description="optimizer of every run")
    eval_se: float = Field(
        0.01, gt=0.0, le=0.5, description="target standard error of each model's held-out reward "
        "(any reward in [0, 1]); sets eval_prompts when that is not given")
    bootstrap: int = Field(2000, ge=100, le=100_000, description="bootstrap replicates of the intervals")
    confidence: float = Field(0.95, ge=0.5, lt=1.0, description="confidence level of the intervals")
    dtype: Dtype = Field("auto", description="dtype the models are loaded in")

    @model_validator(mode="before")
    @classmethod
    def _eval_size(cls, data: Any) -> Any:
        # eval_prompts not given (or null): the size that guarantees SE <= eval_se for any reward
        # in [0, 1] (variance <= 1/4).
        if isinstance(data, dict) and data.get("eval_prompts") is None:
            se = data.get("eval_se", 0.01)
            if isinstance(se, int | float) and not isinstance(se, bool) and 0 < se <= 0.5:
                data = {**data, "eval_prompts": min(100_000, math.ceil(0.25 / se**2 - 1e-9))}
        return data

    @model_validator(mode="after")
    def _opd_teacher(self) -> RetentionSpec:
        if self.algo == "opd" and not self.teacher and self.model not in DEFAULT_TEACHERS:
            raise ValueError(
                f"teacher: algo 'opd' needs a teacher model for {self.model!r} "
                f"(a default exists only for {', '.join(DEFAULT_TEACHERS)})"
            )
        return self


# ---------------------------------------------------------------- result

RETENTION, HELDOUT, TRAIN_REWARD = Family("retention"), Family("heldout"), Family("train_reward")


class RetentionRow(Row):
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


class RetentionResult(TypedResult[RetentionSummary]):
    kind: Literal["retention"]


CONTRACT = Contract("retention", RetentionResult, heatmaps=("retention",),
                    series_families=(RETENTION, HELDOUT, TRAIN_REWARD))


# ---------------------------------------------------------------- the kind


def cost(s: RetentionSpec) -> int:
    """Every arm's run, and a Fisher per seed: a ceiling (queued, each worker that runs an arm
    needing it estimates the one Fisher again; in one process it is made once, see timing)."""
    runs = s.seeds * (len(s.densities) * len(s.selectors) + 1)
    one = train_passes(s.algo, s.steps, s.batch, s.group, s.max_new_tokens, s.eval_prompts,
                       s.gradient_checkpointing)
    fisher = fisher_passes(s.fisher_prompts, s.fisher_samples, s.max_new_tokens)
    return runs * one + s.seeds * fisher


def timing(s: RetentionSpec, z: Sizing) -> dict[str, float]:
    """In one process (queued, the arms run on as many workers at once): the base's evaluation,
    the Fisher once (its sampling seed is the same for every arm, retention_run.FISHER_SEED: the
    process makes it once and keeps it; it had been counted once per seed), and every arm's
    training run and evaluation."""
    runs = s.seeds * (len(s.densities) * len(s.selectors) + 1)
    one = train_seconds(z, s.algo, s.steps, s.batch, s.group, s.max_new_tokens, s.eval_prompts,
                        checkpointing=s.gradient_checkpointing, temperature=s.temperature)
    fisher = sum(fisher_seconds(z, s.fisher_prompts, s.fisher_samples, s.max_new_tokens,
                                statistics=False, temperature=s.temperature).values())
    # a model below 20M parameters runs on one torch thread (retention_run.SMALL_MODEL_PARAMS):
    # counted as the calibration's two, which a quiet machine measures within 0.9-1.3x of one at
    # that size (session 19; the 0.7 share once fitted here came from a run at a load of 6-9)
    masks = s.seeds * len(s.densities) * len(s.selectors)  # each arm's mask (a selection over the weights)
    return {"load": z.load_s(), "initial Fisher": fisher,
            "masks": masks * z.calls_s(MASK_SELECT_CALLS + MASK_CALLS_PER_ELEMENT * z.params),
            "steps": runs * one["steps"],
            # the base's held-out accuracy and every arm's: one greedy evaluation each
            "evaluation": (runs + 1) * one["evaluation"] / 2,
            # a full arm's update sparsity (a masked arm's end is its evaluation)
            "finish": s.seeds * train_finish_seconds(z)}


def memory(s: RetentionSpec, z: Sizing) -> dict[str, float]:
    """One arm's training peak, and what the sweep keeps between arms."""
    return train_memory(z, s.algo, s.batch, s.group, s.max_new_tokens, s.optimizer,
                        teacher=s.algo == "opd", checkpointing=s.gradient_checkpointing,
                        ) | {"kept between arms": RETENTION_STATE_MB * MIB}


def host_memory(s: RetentionSpec, z: Sizing) -> dict[str, float]:
    """On a GPU, the Fisher the masks are chosen from, kept on the host (`memory` counts it on a CPU)."""
    return train_host_memory(z)


def implied_refs(s: RetentionSpec) -> dict[str, str]:
    """The OPD teacher the runner loads when none is given."""
    if s.algo == "opd" and not s.teacher and s.model in DEFAULT_TEACHERS:
        return {"teacher": DEFAULT_TEACHERS[s.model]}
    return {}


KIND = JobKind(
    name="retention", title="Retention", spec=RetentionSpec, contract=CONTRACT,
    runner="compute.jobs.retention_run:run", cost=cost, order=40, timing=timing, memory=memory,
    host_memory=host_memory,
    memory_options=({"gradient_checkpointing": True},),  # every arm's weights the same, a forward more a step
    refs={"model": "model", "teacher": "model"},
    implied_refs=implied_refs,
    form=KindForm(tab="Retention sweep", button="Run retention sweep",
                  main=("model", "algo", "teacher", "densities", "selectors", "seeds", "steps", "lr")),
    example={"model": "arith-base", "seeds": 1},
)
