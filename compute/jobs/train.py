"""The `train` job kind: one GRPO / OPD / SFT run, full or inside a mask (compute/jobs/train_run.py).

Declares the spec, the typed result and its contract, the cost and `KIND`; figures and key numbers
are in app/figures/train.py. A succeeded train job provides its trained model (`job:N` in any
model field) and the mask it built, if any.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from compute.contract.cost import (
    COST_PROMPT_TOKENS,
    Sizing,
    bound_check_runs,
    bound_plan_of,
    bound_seconds,
    fisher_passes,
    fisher_seconds,
    train_finish_seconds,
    train_host_memory,
    train_memory,
    train_passes,
    train_seconds,
)
from compute.contract.kinds import JobKind, KindForm
from compute.contract.results import Contract, Family, Summary, TypedResult
from compute.contract.specs import (
    FISHER_SELECTORS,
    PRECISION_DTYPES,
    AllowOtherModel,
    Dtype,
    FisherPrompts,
    FisherSamples,
    Group,
    IndependentFisher,
    LoopKnobs,
    Selector,
    SftSource,
    TopkPercent,
    WeightDecay,
)

# ---------------------------------------------------------------- spec


class TrainSpec(LoopKnobs):
    # shared knobs (batch, max_new_tokens, kl_coef, ...; optimizer, lr, steps, seed, precision):
    # compute.contract.specs.TrainingKnobs, RunKnobs, LoopKnobs;
    # redeclared here where train's default or description differs
    group: Group = Field(8, description="GRPO completions per prompt")
    weight_decay: WeightDecay = Field(0.0,
        description="decoupled weight decay (masked coordinates only)")
    sft_source: SftSource = Field("gold",
        description="SFT targets: the task's gold answers or the model's own correct samples")
    fisher_prompts: FisherPrompts = Field(32, description="prompts of the Fisher for mask_select")
    fisher_samples: FisherSamples = Field(4, description="samples per prompt of that Fisher")
    mask: str | None = Field(None, max_length=1000, description="mask.safetensors path or 'job:<id>'")
    mask_select: Selector | None = Field(None, description="build a mask in the job with this selector")
    mask_density: float | None = Field(None, gt=0.0, le=1.0, description="density of mask_select")
    dtype: Dtype = Field("auto", description="dtype the model is loaded in")
    bound: bool = Field(True, description="GRPO: check the Cauchy-Schwarz bound on the first batch "
                        "against a Fisher from independent samples")
    fisher: str | None = Field(
        None, max_length=1000, description="initial Fisher (fisher.safetensors path or 'job:<id>') for the "
        "gradient-concentration and bound checks; default: estimated from independent samples")
    allow_other_model: AllowOtherModel = False
    independent_fisher: IndependentFisher = Field(
        "other-prompts", description="samples of the estimated initial Fisher: train prompts after the "
        "ones training uses, or other completions of the first training prompts")
    concentration: bool = Field(
        True, description="accumulate sum g^2 and sum |g| over all steps and compare with the initial Fisher")
    topk_percent: TopkPercent = Field(1.0, description="top-k% of the concentration overlap")
    save_steps: int = Field(
        0, ge=0, le=100_000, description="write OUT/checkpoint-<step> (the HF Trainer / TRL layout: "
        "model.safetensors, config.json, trainer_state.json) every N steps and at the last; 0 = off")

    @model_validator(mode="after")
    def _cross_field(self) -> TrainSpec:
        if self.algo == "opd" and not self.teacher:
            raise ValueError("teacher: algo 'opd' needs a teacher model (e.g. arith-teacher)")
        if self.mask and self.mask_select:
            raise ValueError("mask: give either mask or mask_select + mask_density, not both")
        if self.mask_select and self.mask_density is None:
            raise ValueError("mask_density: needed with mask_select; accepted range: > 0, <= 1")
        if self.mask_density is not None and not self.mask_select:
            raise ValueError("mask_select: mask_density needs a selector (e.g. fisher)")
        if self.dtype not in PRECISION_DTYPES[self.precision]:
            raise ValueError(f"dtype: {self.dtype!r} conflicts with precision {self.precision!r}; accepted: "
                             f"{', '.join(PRECISION_DTYPES[self.precision])}")
        saved = -(-self.steps // self.save_steps) if self.save_steps else 0
        if saved > MAX_SAVED_CHECKPOINTS:
            raise ValueError(f"save_steps: {self.save_steps} writes {saved} checkpoints for {self.steps} steps; "
                             f"accepted: at most {MAX_SAVED_CHECKPOINTS} "
                             f"(save_steps >= {-(-self.steps // MAX_SAVED_CHECKPOINTS)})")
        return self


MAX_SAVED_CHECKPOINTS = 200  # a train job's checkpoint-N folders (each a full model copy)


# ---------------------------------------------------------------- result

TRAIN_METRICS = ("reward", "loss", "accuracy", "reverse_kl", "kl", "grad_norm")
CONCENTRATION_TARGETS = ("grad_sq_sum", "grad_abs_sum", "abs_delta")
BOUND_POINTS, BOUND_RHS = "bound/|grad|", "bound/rhs"
EVAL_ACCURACY = "eval/accuracy"
TRAIN = Family("train")
BOUND_HIST = "bound_log_hist"
CONCENTRATION_AUC = tuple(f"concentration_auc_{t}" for t in CONCENTRATION_TARGETS)


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
    bound_skipped: str | None = None  # issue 30: a check that does not fit the device is not run
    concentration: dict[str, Any] | None = None


class TrainResult(TypedResult[TrainSummary]):
    kind: Literal["train"]


CONTRACT = Contract("train", TrainResult, heatmaps=(BOUND_HIST, *CONCENTRATION_AUC),
                    series=(*(f"train/{m}" for m in TRAIN_METRICS), EVAL_ACCURACY, BOUND_POINTS, BOUND_RHS))


# ---------------------------------------------------------------- the kind


def cost(s: TrainSpec) -> int:
    n = train_passes(s.algo, s.steps, s.batch, s.group, s.max_new_tokens, s.eval_prompts,
                     s.gradient_checkpointing)
    if s.mask_select in FISHER_SELECTORS:  # a mask chosen by a Fisher estimates one in the job
        n += fisher_passes(s.fisher_prompts, s.fisher_samples, s.max_new_tokens)
    bound = s.algo == "grpo" and s.bound
    if not s.fisher and (s.concentration or bound):
        n += fisher_passes(s.fisher_prompts, s.fisher_samples, s.max_new_tokens)  # independent Fisher
    if bound:  # one backward per sample of the first batch
        n += s.batch * s.group * (COST_PROMPT_TOKENS + s.max_new_tokens) * 3
    return n


def bound_runs(s: TrainSpec, z: Sizing) -> bool:
    """Whether the job will run GRPO's bound check on this Sizing (compute.contract.cost
    bound_check_runs: it fits, in groups of coordinates, beside the weights and the initial Fisher
    it would need)."""
    return s.algo == "grpo" and s.bound and bound_check_runs(z, s.algo == "opd", True)


def timing(s: TrainSpec, z: Sizing) -> dict[str, float]:
    """Load, the Fisher a mask or the concentration needs, the bound check, the steps, the
    held-out accuracy before and after, and the run's end (update sparsity, saving)."""
    out = {"load": z.load_s()}
    fishers = int(s.mask_select in FISHER_SELECTORS) + int(not s.fisher and (s.concentration or bound_runs(s, z)))
    if fishers:
        one = fisher_seconds(z, s.fisher_prompts, s.fisher_samples, s.max_new_tokens, statistics=False,
                             temperature=s.temperature)
        out["initial Fisher"] = fishers * sum(one.values())
    if bound_runs(s, z):
        groups = len(bound_plan_of(z, s.algo == "opd", True).groups)
        out["bound check"] = bound_seconds(z, s.batch * s.group, s.max_new_tokens, groups, s.temperature)
    out.update(train_seconds(z, s.algo, s.steps, s.batch, s.group, s.max_new_tokens, s.eval_prompts,
                             checkpointing=s.gradient_checkpointing, temperature=s.temperature,
                             sft_source=s.sft_source))
    out["finish"] = train_finish_seconds(z)
    return out


def needs_initial_fisher(s: TrainSpec, bound: bool | None = None) -> bool:
    """Whether the run holds an initial Fisher: a given file, or one estimated from independent
    samples for the concentration report or GRPO's bound (train_run._initial_fisher). `bound`:
    whether the bound check will run (a skipped one needs no Fisher); default: whether it is asked."""
    bound = (s.algo == "grpo" and s.bound) if bound is None else bound
    return bool(s.fisher) or s.concentration or bound


def memory(s: TrainSpec, z: Sizing) -> dict[str, float]:
    """compute.contract.cost.train_memory; a mask chosen here trains mask_density of the
    coordinates, a given mask file the density its header records (app.limits.mask_density;
    counted as all of them when it records none)."""
    fraction = s.mask_density if s.mask_select and s.mask_density else 1.0
    if s.mask and z.mask_density is not None:
        fraction = z.mask_density
    return train_memory(z, s.algo, s.batch, s.group, s.max_new_tokens, s.optimizer, fraction,
                        s.concentration, teacher=s.algo == "opd", initial_fisher=needs_initial_fisher(s, bound_runs(s, z)),
                        checkpointing=s.gradient_checkpointing, bound=s.algo == "grpo" and s.bound)


def host_memory(s: TrainSpec, z: Sizing) -> dict[str, float]:
    """compute.contract.cost.train_host_memory: on a GPU, the initial Fisher the run needs, kept
    on the host beside the device's peak (`memory`)."""
    return train_host_memory(z, needs_initial_fisher(s, bound_runs(s, z)))


KIND = JobKind(
    name="train", title="Training run", spec=TrainSpec, contract=CONTRACT, runner="compute.jobs.train_run:run",
    cost=cost, order=30, timing=timing, memory=memory, host_memory=host_memory,
    # the same weights, one forward more a step; GRPO without its bound check (cost.bound_plan)
    memory_options=({"gradient_checkpointing": True}, {"bound": False}),
    refs={"model": "model", "teacher": "model", "mask": "mask", "fisher": "fisher"},
    outputs={"model": "model", "mask": "mask", "run_dir": "model"},  # run_dir: checkpoint-N with save_steps
    form=KindForm(tab="Train", button="Train",
                  main=("model", "task", "algo", "teacher", "mask", "mask_select", "mask_density",
                        "optimizer", "lr", "steps", "batch", "group", "seed", "precision")),
    example={"model": "arith-base", "steps": 10},
)
