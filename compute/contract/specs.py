"""Job specs: validated at the edge (CLI, REST API, UI) before anything is queued.

Pydantic only, no torch: the web process imports this. Keys are the matching CLI command's flag
names with dashes as underscores (`--max-new-tokens` -> `max_new_tokens`). Every numeric field has
bounds so that no request can make a worker allocate unbounded memory; the error names the field
and the accepted range.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

# FieldInfo and describe_fields are re-exported: generators import them from here with the specs
from compute.contract.spec_fields import BOUND_KEYS, constraints
from compute.contract.spec_fields import FieldInfo as FieldInfo
from compute.contract.spec_fields import describe_fields as describe_fields

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Estimator = Literal["sequence", "token", "empirical", "batch"]
Selector = Literal[
    "fisher", "fisher-tensor", "fisher-bottom", "random", "magnitude", "magnitude-bottom", "gradient"
]
Algo = Literal["grpo", "opd", "sft"]
Precision = Literal["fp32", "bf16-mixed", "bf16"]
# Retention's OPD teacher when none is given (compute.run_retention uses this table).
DEFAULT_TEACHERS = {"arith-base": "arith-teacher"}


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def spec_hash(self) -> str:
        """Stable hash of the full spec (defaults included) for result reuse."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(f"{type(self).__name__}:{blob}".encode()).hexdigest()


def _check_task(name: str) -> str:
    """Task name and options (e.g. arithmetic?digits=1000000 is refused here, not in a worker).
    jsonl: files are checked where the allowed roots are known (app.services.validate)."""
    from compute.tasks import get_task

    if name.startswith("jsonl:"):
        path, _, query = name[len("jsonl:"):].partition("?")
        if not path.strip():
            raise ValueError("'jsonl:' needs a path, e.g. jsonl:/data/gsm8k.jsonl")
        for key, _eq, value in (part.partition("=") for part in query.split("&") if part):
            if key != "match":
                raise ValueError(f"unknown option {key!r} in {name!r}; accepted: match")
            if value not in ("exact", "numeric"):
                raise ValueError(f"match={value!r} is not accepted; accepted: exact, numeric")
        return name
    try:
        get_task(name)
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg[len("task: "):] if msg.startswith("task: ") else msg) from None
    return name


_DEVICE = r"^(auto|cpu|mps|cuda(:\d{1,2})?)$"

ModelRef = Annotated[
    str,
    Field(
        min_length=1,
        max_length=500,
        description="zoo name, local HF dir, hub id org/name, or job:N (a succeeded train job)",
    ),
]
TaskRef = Annotated[
    str,
    Field(
        min_length=1,
        max_length=500,
        description="'arithmetic', 'arithmetic-add', 'arithmetic-mul' (options after '?', e.g. "
        "'arithmetic-add?digits=3'), or 'jsonl:PATH'",
    ),
    AfterValidator(_check_task),
]
Device = Annotated[
    str, Field(max_length=32, pattern=_DEVICE, description="auto | cpu | mps | cuda | cuda:N")
]


# Knobs several specs share: the accepted range is written once here (each spec sets its default).
Seed = Annotated[int, Field(ge=0, le=2**31 - 1)]
Steps = Annotated[int, Field(ge=1, le=100_000)]
Batch = Annotated[int, Field(ge=1, le=1024)]
Group = Annotated[int, Field(ge=2, le=64)]
MaxNewTokens = Annotated[int, Field(ge=1, le=1024)]
Temperature = Annotated[float, Field(gt=0.0, le=5.0)]
Lr = Annotated[float, Field(gt=0.0, le=10.0)]
WeightDecay = Annotated[float, Field(ge=0.0, le=10.0)]
Momentum = Annotated[float, Field(ge=0.0, lt=1.0)]
KlCoef = Annotated[float, Field(ge=0.0, le=100.0)]
ClipEps = Annotated[float, Field(gt=0.0, le=10.0)]
FisherPrompts = Annotated[int, Field(ge=1, le=4096)]
FisherSamples = Annotated[int, Field(ge=1, le=64)]
TopkPercent = Annotated[float, Field(gt=0.0, le=100.0)]
Optimizer = Literal["adamw", "sgd"]
SftSource = Literal["gold", "self"]
DistillEstimator = Literal["full", "sampled"]
IndependentFisher = Literal["other-prompts", "other-completions"]


class FisherSpec(_Spec):
    model: ModelRef
    task: TaskRef = "arithmetic"
    # issue 18: the default gives a 'fair' split-half verdict on arith-base (measured: 16 x 4 samples
    # -> top-1% Jaccard 0.35 'unreliable', 32 -> 0.48, 64 -> 0.55 'fair')
    prompts: FisherPrompts = Field(64, description="number of task prompts (64 x 4 samples: split-half "
                                   "verdict 'fair' on arith-base; 16 gave 'unreliable')")
    samples: FisherSamples = Field(4, description="sampled completions per prompt")
    estimator: Estimator = Field("sequence",
        description="sequence | token | empirical | batch (which Fisher is estimated)")
    seed: Seed = Field(0, description="seed of prompts and samples")
    max_new_tokens: MaxNewTokens = Field(16, description="completion length limit")
    temperature: Temperature = Field(1.0,
        description="sampling temperature; 1.0 = the model's distribution")
    top_k: int | None = Field(None, ge=1, le=100_000, description="None = full distribution")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="None = full distribution")
    prompt_start: int = Field(0, ge=0, le=1_000_000, description="first prompt index (sharding)")
    shards: int = Field(1, ge=1, le=64, description="split the prompts over this many workers")
    topk_percent: TopkPercent = Field(1.0, description="top-k% used for split-half stability")
    exact_output: bool = Field(True, description="also compute the exact output-layer Fisher")
    until_reliable: bool = Field(
        False, description="when the split-half verdict is below 'fair' (top-k Jaccard < 0.5), add as many "
        "prompts again (doubling) until it is fair, up to max_prompts; the result records every round")
    max_prompts: FisherPrompts = Field(512, description="cap on the prompts until_reliable may reach")
    dtype: Dtype = Field(
        "float32", description="dtype of the forward/backward: float32 on every device by default (sums "
        "are float32 whatever this is); bfloat16/float16 are faster on GPUs and the result states their "
        "error against float32 on the same samples; auto = bfloat16 on CUDA")
    device: Device = "auto"
    memory_budget_mb: int | None = Field(
        None, ge=64, le=1_048_576,
        description="bound on per-sample-gradient temporaries (MiB); None = a quarter of free device memory",
    )

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


class MaskSpec(_Spec):
    fisher: str | None = Field(
        None, max_length=1000, description="fisher.safetensors path or 'job:<id>' of a fisher job"
    )
    select: Selector = Field("fisher", description="how coordinates are chosen")
    density: float = Field(0.05, gt=0.0, le=1.0, description="fraction of all coordinates kept")
    model: ModelRef | None = Field(None,
        description="weights for magnitude*, shapes for random, gradients for gradient")
    task: TaskRef = Field("arithmetic", description="task of the gradient selector")
    seed: Seed = Field(0, description="seed of the random selector")
    prompts: int = Field(16, ge=1, le=4096, description="prompts for the 'gradient' selector")
    gradient: str | None = Field(
        None, max_length=1000,
        description="gradient.safetensors path or 'job:<id>' for the 'gradient' selector "
        "(default: computed from the SFT loss on `prompts` gold answers of `task`)",
    )

    @model_validator(mode="after")
    def _selector_inputs(self) -> MaskSpec:
        sel = self.select
        if sel.startswith("fisher") and not self.fisher:
            raise ValueError(f"fisher: selector {sel!r} needs a Fisher (job:<id> of a fisher job)")
        if sel.startswith("magnitude") and not self.model:
            raise ValueError(f"model: selector {sel!r} needs the model (its weights are ranked)")
        if sel == "gradient" and not (self.gradient or self.model):
            raise ValueError("model: selector 'gradient' needs a model (or a gradient file)")
        if sel == "random" and not (self.model or self.fisher):
            raise ValueError("model: selector 'random' needs a model or a Fisher (for tensor shapes)")
        return self
    device: Device = "auto"


class TrainSpec(_Spec):
    model: ModelRef
    task: TaskRef = "arithmetic"
    algo: Algo = Field("grpo", description="post-training algorithm")
    teacher: ModelRef | None = Field(None, description="teacher model for opd (same tokenizer)")
    mask: str | None = Field(None, max_length=1000, description="mask.safetensors path or 'job:<id>'")
    mask_select: Selector | None = Field(None, description="build a mask in the job with this selector")
    mask_density: float | None = Field(None, gt=0.0, le=1.0, description="density of mask_select")
    optimizer: Optimizer = Field("adamw", description="optimizer of the trained coordinates")
    lr: Lr = Field(
        2e-4, description="AdamW 1e-3 collapses GRPO on arith-base; 2e-4 is stable"
    )
    weight_decay: WeightDecay = Field(0.0,
        description="decoupled weight decay (masked coordinates only)")
    steps: Steps = Field(30, description="optimizer steps")
    batch: Batch = Field(8, description="prompts per step")
    group: Group = Field(8, description="GRPO completions per prompt")
    kl_coef: KlCoef = Field(0.0, description="GRPO KL to the reference")
    clip_eps: ClipEps = Field(0.2, description="GRPO ratio clip")
    sft_source: SftSource = Field("gold",
        description="SFT targets: the task's gold answers or the model's own correct samples")
    max_new_tokens: MaxNewTokens = Field(16, description="sampled completion length")
    eval_prompts: int = Field(200, ge=1, le=100_000, description="held-out prompts for greedy accuracy")
    seed: Seed = Field(0, description="seed of prompts, sampling and selectors")
    dtype: Dtype = Field("auto", description="dtype the model is loaded in")
    device: Device = "auto"
    momentum: Momentum = Field(0.0, description="SGD momentum")
    grad_clip: float | None = Field(1.0, gt=0.0, le=1e6, description="max grad norm; None = off")
    temperature: Temperature = Field(1.0, description="sampling temperature")
    distill_estimator: DistillEstimator = Field(
        "full", description="OPD reverse KL: exact over the vocabulary, or sampled-token estimate"
    )
    fisher_prompts: FisherPrompts = Field(32, description="prompts of the Fisher for mask_select")
    fisher_samples: FisherSamples = Field(4, description="samples per prompt of that Fisher")
    bound: bool = Field(True, description="GRPO: check the Cauchy-Schwarz bound on the first batch "
                        "against a Fisher from independent samples")
    precision: Precision = Field(
        "fp32", description="fp32 | bf16-mixed (fp32 master weights, bf16 checkpoint) | bf16 (bf16 weights: "
        "updates below half a bf16 ULP are lost)")
    fisher: str | None = Field(
        None, max_length=1000, description="initial Fisher (fisher.safetensors path or 'job:<id>') for the "
        "gradient-concentration and bound checks; default: estimated from independent samples")
    independent_fisher: IndependentFisher = Field(
        "other-prompts", description="samples of the estimated initial Fisher: train prompts after the "
        "ones training uses, or other completions of the first training prompts")
    concentration: bool = Field(
        True, description="accumulate sum g^2 and sum |g| over all steps and compare with the initial Fisher")
    topk_percent: TopkPercent = Field(1.0, description="top-k% of the concentration overlap")

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
        return self


# dtypes a model may be loaded in for each training precision (precision sets the training dtype)
PRECISION_DTYPES = {"fp32": ("auto", "float32"), "bf16-mixed": ("auto", "float32", "bfloat16"),
                    "bf16": ("auto", "bfloat16")}


class SweepSpec(_Spec):
    """A grid of training runs, lr x optimizer x precision, each followed by a diff of its stored
    checkpoint against the base's (compute.run_sweep). Defaults: minutes on arith-base, 2 cores."""

    model: ModelRef
    task: TaskRef = "arithmetic"
    algo: Algo = Field("grpo", description="post-training algorithm")
    teacher: ModelRef | None = Field(None, description="teacher model for opd (same tokenizer)")
    lrs: list[Lr] = Field(
        default_factory=lambda: [1e-6, 1e-5, 1e-4, 1e-3], min_length=1, max_length=16,
        description="learning rates of the grid")
    optimizers: list[Optimizer] = Field(
        description="optimizers of the grid",
        default_factory=lambda: ["adamw", "sgd"], min_length=1, max_length=2)
    precision: list[Precision] = Field(
        default_factory=lambda: ["bf16-mixed"], min_length=1, max_length=3,
        description="training precisions of the grid (fp32, bf16-mixed, bf16)")
    steps: Steps = Field(20, description="optimizer steps per point")
    batch: Batch = Field(8, description="prompts per step")
    group: Group = Field(8, description="completions per prompt")
    max_new_tokens: MaxNewTokens = Field(16, description="sampled completion length")
    eval_prompts: int = Field(200, ge=1, le=100_000, description="held-out prompts for greedy accuracy")
    seed: Seed = Field(0, description="seed of prompts and sampling")
    weight_decay: WeightDecay = Field(0.0, description="decoupled weight decay")
    momentum: Momentum = Field(0.0, description="SGD momentum")
    grad_clip: float | None = Field(1.0, gt=0.0, le=1e6, description="max grad norm; None = off")
    temperature: Temperature = Field(1.0, description="sampling temperature")
    kl_coef: KlCoef = Field(0.0, description="GRPO KL to the reference")
    clip_eps: ClipEps = Field(0.2, description="GRPO ratio clip")
    sft_source: SftSource = Field("gold",
        description="SFT targets: gold answers or the model's own correct samples")
    distill_estimator: DistillEstimator = Field("full",
        description="OPD reverse KL: exact over the vocabulary, or sampled-token estimate")
    fisher: str | None = Field(
        None, max_length=1000, description="initial Fisher (path or 'job:<id>'); default: estimated once "
        "from independent samples")
    independent_fisher: IndependentFisher = Field("other-prompts",
        description="samples of the estimated initial Fisher")
    fisher_prompts: FisherPrompts = Field(32, description="prompts of the initial Fisher")
    fisher_samples: FisherSamples = Field(4, description="samples per prompt of the initial Fisher")
    topk_percent: TopkPercent = Field(1.0, description="top-k% of the Fisher/gradient overlap")
    device: Device = "auto"

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


class RetentionSpec(_Spec):
    """Defaults tuned on arith-base (GRPO, 100 steps: held-out greedy accuracy ~0.27 -> ~0.4) so the
    default grid runs in minutes on 2 CPU cores; statistics in compute.retention."""

    model: ModelRef = Field("arith-base", description="zoo name, local HF dir, hub id org/name, or job:N")
    task: TaskRef = "arithmetic"
    algo: Algo = Field("grpo", description="post-training algorithm")
    teacher: ModelRef | None = Field(None,
        description="teacher for opd (default: arith-teacher for arith-base)")
    densities: list[Annotated[float, Field(gt=0.0, le=1.0)]] = Field(
        default_factory=lambda: [0.01, 0.05, 0.1], min_length=1, max_length=16, description="mask densities"
    )
    selectors: list[Selector] = Field(
        description="mask selectors",
        default_factory=lambda: ["fisher", "random", "magnitude"], min_length=1, max_length=8
    )
    seeds: int = Field(3, ge=1, le=16, description="paired seeds: each runs full training and every mask")
    steps: Steps = Field(100, description="optimizer steps per run")
    lr: Lr = Field(2e-4, description="learning rate")
    optimizer: Optimizer = Field("adamw", description="optimizer of every run")
    fisher_prompts: FisherPrompts = Field(64, description="prompts of the initial Fisher")
    fisher_samples: FisherSamples = Field(4, description="samples per prompt of the initial Fisher")
    eval_prompts: int = Field(
        2500, ge=2, le=100_000, description="held-out prompts (the same for every model); when not "
        "given: ceil(0.25 / eval_se^2), so every model's mean reward has standard error <= eval_se")
    eval_se: float = Field(
        0.01, gt=0.0, le=0.5, description="target standard error of each model's held-out reward "
        "(any reward in [0, 1]); sets eval_prompts when that is not given")
    bootstrap: int = Field(2000, ge=100, le=100_000, description="bootstrap replicates of the intervals")
    confidence: float = Field(0.95, ge=0.5, lt=1.0, description="confidence level of the intervals")
    device: Device = "auto"
    batch: Batch = Field(16, description="prompts per step")
    group: Group = Field(8, description="completions sampled per prompt")
    max_new_tokens: MaxNewTokens = Field(6, description="sampled completion length")
    weight_decay: WeightDecay = Field(0.0, description="decoupled weight decay")
    momentum: Momentum = Field(0.0, description="SGD momentum")
    temperature: Temperature = Field(1.0, description="sampling temperature")
    kl_coef: KlCoef = Field(0.0, description="GRPO KL to the reference")
    distill_estimator: DistillEstimator = Field("full",
        description="OPD reverse KL: exact over the vocabulary, or sampled-token estimate")
    dtype: Dtype = Field("auto", description="dtype the models are loaded in")

    @model_validator(mode="before")
    @classmethod
    def _eval_size(cls, data: Any) -> Any:
        # eval_prompts not given (or 0/None): the size that guarantees SE <= eval_se for any reward
        # in [0, 1] (variance <= 1/4).
        if isinstance(data, dict) and not data.get("eval_prompts"):
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


class DiffSpec(_Spec):
    base: ModelRef
    tuned: ModelRef
    fisher: str | None = Field(None, max_length=1000, description="fisher.safetensors path or 'job:<id>'")
    topk_percent: TopkPercent = Field(1.0,
        description="top-k% used for the Fisher/|delta| overlap")
    store_delta: bool = Field(False, description="also store the full float32 delta as an artifact (large)")
    svd_max_numel: int = Field(
        16_000_000, ge=0, le=10_000_000_000, description="skip rank/SVD of 2-D deltas above this size"
    )


class TokensSpec(_Spec):
    model: ModelRef
    context: str = Field(..., min_length=1, max_length=2000, description="text before the next token")
    top_k: int = Field(8, ge=2, le=64, description="number of top next tokens")
    layer: int | None = Field(None, ge=0, le=1000, description="None = whole model")
    random_k: int = Field(8, ge=0, le=64, description="random tokens for contrast")
    seed: Seed = Field(0, description="seed of the random tokens")
    low_k: int = Field(8, ge=0, le=64, description="least likely tokens for contrast")
    full_vocab_max: int = Field(1024, ge=1, le=1_000_000, description="enumerate the whole vocabulary up to this size")
    mass_target: float = Field(0.99, gt=0.0, le=1.0, description="probability mass covered for larger vocabularies")
    max_tokens: int = Field(256, ge=1, le=4096, description="cap on tokens enumerated for the Fisher trace")
    memory_budget_mb: int | None = Field(
        None, ge=16, le=1_048_576,
        description="gradient rows held per chunk (MiB); None = a quarter of free device memory",
    )
    dtype: Dtype = Field("auto", description="dtype the model is loaded in")
    device: Device = "auto"

    @field_validator("context")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("context must contain at least one non-space character")
        return v


SPECS: dict[str, type[_Spec]] = {
    "fisher": FisherSpec,
    "mask": MaskSpec,
    "train": TrainSpec,
    "sweep": SweepSpec,
    "retention": RetentionSpec,
    "diff": DiffSpec,
    "tokens": TokensSpec,
}


class SpecError(ValueError):
    """A user-facing validation error: `errors` is a list of {field, message}."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


def parse_spec(kind: str, data: dict[str, Any]) -> _Spec:
    """Validate `data` for job `kind`; raise SpecError naming each bad field and its accepted range."""
    if kind not in SPECS:
        raise SpecError([{"field": "kind", "message": f"unknown job kind {kind!r}; accepted: {', '.join(SPECS)}"}])
    if not isinstance(data, dict):
        raise SpecError([{"field": "spec", "message": "must be a JSON object"}])
    data = {k.replace("-", "_"): v for k, v in data.items()}
    try:
        return SPECS[kind].model_validate(data)
    except ValidationError as exc:
        raise SpecError([_friendly(e, SPECS[kind]) for e in exc.errors()]) from None


def _friendly(err: Any, cls: type[BaseModel]) -> dict[str, str]:
    field = ".".join(str(p) for p in err.get("loc", ())) or "spec"
    ctx = err.get("ctx") or {}
    typ = err.get("type", "")
    value = err.get("input")
    bounds = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    if typ in {"greater_than_equal", "greater_than", "less_than_equal", "less_than"}:
        # Say the whole range (both ends), not only the violated one.
        rng = ", ".join(f"{bounds[k]} {v}" for k, v in _bounds(cls, err.get("loc", ())).items())
        rng = rng or ", ".join(f"{bounds[k]} {v}" for k, v in ctx.items() if k in bounds)
        return {"field": field, "message": f"got {value!r}; accepted range: {rng}"}
    if typ == "extra_forbidden":
        return {"field": field, "message": "unknown field"}
    if typ == "literal_error":
        return {"field": field, "message": f"got {value!r}; accepted: {ctx.get('expected')}"}
    if typ == "value_error":
        msg = str(ctx.get("error") or err.get("msg", "invalid value"))
        head, sep, rest = msg.partition(": ")
        if field == "spec" and sep and head in cls.model_fields:  # a cross-field rule
            return {"field": head, "message": rest}
        return {"field": field, "message": msg}
    if typ == "string_pattern_mismatch" and field.split(".")[-1] == "device":
        return {"field": field, "message": f"got {value!r}; accepted: auto, cpu, mps, cuda, cuda:N"}
    if typ in {"int_from_float", "int_parsing", "int_type"}:
        return {"field": field, "message": f"got {value!r}; give a whole number"}
    return {"field": field, "message": err.get("msg", "invalid value")}


def _bounds(cls: type[BaseModel], loc: tuple[Any, ...]) -> dict[str, Any]:
    """The numeric bounds declared on a top-level field (e.g. {'ge': 1, 'le': 4096})."""
    info = cls.model_fields.get(str(loc[0])) if loc else None
    cons = constraints(info.metadata) if info else {}
    return {k: cons[k] for k in BOUND_KEYS if k in cons}
