"""The `sweep` job kind: training runs over lr x optimizer x precision, each diffed against the
base (compute/jobs/sweep_run.py; fans out one child per grid point).

Declares the spec, the typed result and its contract, the cost and `KIND`; figures and key numbers
are in app/figures/sweep.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from compute.contract.cost import (
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
from compute.contract.results import PRECISIONS, Contract, Family, Row, Summary, TypedResult
from compute.contract.specs import (
    AllowOtherModel,
    IndependentFisher,
    Lr,
    Optimizer,
    Precision,
    RunKnobs,
    Seed,
    Steps,
    TopkPercent,
)

# ---------------------------------------------------------------- spec


class SweepSpec(RunKnobs):
    """A grid of training runs, lr x optimizer x precision, each followed by a diff of its stored
    checkpoint against the base's (compute.jobs.sweep_run). Defaults: minutes on arith-base, 2 cores."""

    # shared knobs (batch, group, max_new_tokens, kl_coef, ...): compute.contract.specs.RunKnobs
    lrs: list[Lr] = Field(
        default_factory=lambda: [1e-6, 1e-5, 1e-4, 1e-3], min_length=1, max_length=16,
        description="learning rates of the grid")
    optimizers: list[Optimizer] = Field(
        description="optimizers of the grid",
        default_factory=lambda: list[Optimizer](["adamw", "sgd"]), min_length=1, max_length=2)
    precision: list[Precision] = Field(
        default_factory=lambda: list[Precision](["bf16-mixed"]), min_length=1, max_length=3,
        description="training precisions of the grid (fp32, bf16-mixed, bf16)")
    steps: Steps = Field(20, description="optimizer steps per point")
    seed: Seed = Field(0, description="seed of prompts and sampling")
    fisher: str | None = Field(
        None, max_length=1000, description="initial Fisher (path or 'job:<id>'); default: estimated once "
        "from independent samples")
    allow_other_model: AllowOtherModel = False
    independent_fisher: IndependentFisher = Field("other-prompts",
        description="samples of the estimated initial Fisher")
    topk_percent: TopkPercent = Field(1.0, description="top-k% of the Fisher/gradient overlap")

    @model_validator(mode="after")
    def _cross_field(self) -> SweepSpec:
        if self.algo == "opd" and not self.teacher:
            raise ValueError("teacher: algo 'opd' needs a teacher model (e.g. arith-teacher)")
        for name in ("lrs", "optimizers", "precision"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: got {values}; each value at most once")
        points = len(self.lrs) * len(self.optimizers) * len(self.precision)
        if points > 48:
            raise ValueError(f"lrs: the grid has {points} points; accepted: at most 48")
        return self


# ---------------------------------------------------------------- result

SWEEP_METRICS = ("unchanged_bf16", "fisher_auc_changed", "fisher_auc_gradient")
SWEEP_SERIES = ("unchanged_bf16", "unchanged_exact", "fisher_auc_changed", "fisher_auc_gradient")
SWEEP_HEATMAPS = tuple(f"sweep_{m}_{p}" for m in SWEEP_METRICS for p in PRECISIONS)
SWEEP = {m: Family(f"sweep/{m}") for m in SWEEP_SERIES}  # sweep/<metric>/<optimizer> <precision>


class SweepPoint(Row):
    lr: float
    optimizer: str
    precision: str
    unchanged_bf16: float | None = None
    unchanged_exact: float | None = None
    unchanged_common: float | None = None  # compute.contract.precision: in comparison_dtype
    comparison_dtype: str | None = None
    fisher_auc_changed: float | None = None
    fisher_auc_changed_within_binades: float | None = None
    fisher_auc_gradient: float | None = None
    fisher_auc_changed_by_binade: list[dict[str, Any]] | None = None
    reward_before: float | None = None
    reward_after: float | None = None
    reward_before_se: float | None = None  # one binomial SE over the held-out prompts
    reward_after_se: float | None = None


class SweepSummary(Summary):
    algo: str | None = None
    points: list[SweepPoint] = Field(default_factory=list)
    markdown: str | None = None


class SweepResult(TypedResult[SweepSummary]):
    kind: Literal["sweep"]


CONTRACT = Contract("sweep", SweepResult, heatmaps=SWEEP_HEATMAPS, series_families=tuple(SWEEP.values()))


# ---------------------------------------------------------------- the kind


def cost(s: SweepSpec) -> int:
    points = len(s.lrs) * len(s.optimizers) * len(s.precision)
    one = train_passes(s.algo, s.steps, s.batch, s.group, s.max_new_tokens, s.eval_prompts,
                       s.gradient_checkpointing)
    fisher = 0 if s.fisher else fisher_passes(s.fisher_prompts, s.fisher_samples, s.max_new_tokens)
    return points * one + fisher


def timing(s: SweepSpec, z: Sizing) -> dict[str, float]:
    """Every point in one process (queued, the points run on as many workers at once): the
    initial Fisher once (its model loaded for it), then per point a training run's parts (load,
    steps, evaluation, its end: diff, saving), by the names a train's estimate and the job's
    `seconds_parts` use."""
    points = len(s.lrs) * len(s.optimizers) * len(s.precision)
    one = train_seconds(z, s.algo, s.steps, s.batch, s.group, s.max_new_tokens, s.eval_prompts,
                        checkpointing=s.gradient_checkpointing, temperature=s.temperature,
                        sft_source=s.sft_source)
    out = {"initial Fisher": 0.0 if s.fisher else sum(fisher_seconds(
        z, s.fisher_prompts, s.fisher_samples, s.max_new_tokens, statistics=False,
        temperature=s.temperature).values()) + z.load_s()}
    # the first point's model in a fresh process when the Fisher is given, else warm: loaded again
    out["load"] = (z.load_s() - z.reload_s() if s.fisher else 0.0) + points * z.reload_s()
    out.update({k: points * v for k, v in one.items()})
    out["finish"] = points * train_finish_seconds(z)
    return out


def memory(s: SweepSpec, z: Sizing) -> dict[str, float]:
    """One point at a time: a training run's peak (the largest optimizer state of the grid)."""
    opt = "adamw" if "adamw" in s.optimizers else s.optimizers[0]
    return train_memory(z, s.algo, s.batch, s.group, s.max_new_tokens, opt, teacher=s.algo == "opd",
                        checkpointing=s.gradient_checkpointing)


def host_memory(s: SweepSpec, z: Sizing) -> dict[str, float]:
    """On a GPU, the sweep's one initial Fisher (given or estimated), kept on the host for every point."""
    return train_host_memory(z)


KIND = JobKind(
    name="sweep", title="LR x optimizer sweep", spec=SweepSpec, contract=CONTRACT,
    runner="compute.jobs.sweep_run:run", cost=cost, order=50, timing=timing, memory=memory,
    host_memory=host_memory,
    memory_options=({"gradient_checkpointing": True},),  # every point's weights the same, a forward more a step
    refs={"model": "model", "teacher": "model", "fisher": "fisher"},
    form=KindForm(tab="LR x optimizer sweep", button="Run sweep",
                  main=("model", "algo", "teacher", "lrs", "optimizers", "precision", "steps", "seed")),
    example={"model": "arith-base", "lrs": [1e-4], "optimizers": ["adamw"]},
)
