"""What job specs share: the base class, field types and ranges several kinds use, and the
friendly validation errors. Each kind's spec class is in compute/jobs/<kind>.py; the training
knobs train, sweep and retention share are declared once, in `TrainingKnobs` and `RunKnobs`.

Specs are validated at the edge (CLI, REST API, UI) before anything is queued.

Pydantic only, no torch: the web process imports this. Keys are the matching CLI command's flag
names with dashes as underscores (`--max-new-tokens` -> `max_new_tokens`). Every numeric field has
bounds so that no request can make a worker allocate unbounded memory; the error names the field
and the accepted range.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
)

# FieldInfo and describe_fields are re-exported: generators import them from here with the specs
from compute.contract.spec_fields import BOUND_KEYS, constraints
from compute.contract.spec_fields import FieldInfo as FieldInfo
from compute.contract.spec_fields import describe_fields as describe_fields
from compute.contract.tasknames import parse_task_name

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Estimator = Literal["sequence", "token", "empirical", "batch"]
Selector = Literal[
    "fisher", "fisher-tensor", "fisher-bottom", "random", "magnitude", "magnitude-bottom", "gradient"
]
# the selectors that rank coordinates by a Fisher: a job that chooses a mask with one estimates a
# Fisher where none is given (compute.jobs.train_run.build_mask_in_memory); the others (random,
# magnitude, gradient) need none, and the estimate counts none for them (compute.jobs.train)
FISHER_SELECTORS: tuple[str, ...] = ("fisher", "fisher-tensor", "fisher-bottom")
Algo = Literal["grpo", "opd", "sft"]
Precision = Literal["fp32", "bf16-mixed", "bf16"]
class Spec(BaseModel):
    """Base of every job spec (compute/jobs/<kind>.py): frozen, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def spec_hash(self) -> str:
        """Stable hash of the full spec (defaults included) for result reuse."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(f"{type(self).__name__}:{blob}".encode()).hexdigest()


def _check_task(name: str) -> str:
    """Task name and options (e.g. arithmetic?digits=1000000 is refused here, not in a worker),
    by the one parser, compute.contract.tasknames.parse_task_name (memoised: the engine's
    get_task reuses this parse). jsonl: files are checked where the allowed roots are known
    (app.services.validate)."""
    try:
        parse_task_name(name)
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
# issue 27: a mask or Fisher made for another revision of the model (same names and shapes) is
# refused at submit unless the user says so (app.services.compat.model_fit)
AllowOtherModel = Annotated[bool, Field(
    description="use a mask / Fisher made for another model revision of the same shapes (refused otherwise)")]
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


class FisherKnobs(Spec):
    """What an estimate of the Fisher is made of: the estimator and how its samples are drawn,
    declared once. The fisher job's spec (compute/jobs/fisher.py) adds the model, task and the
    job's own options; the engine's configuration (compute.fisher.FisherConfig) adds only the
    batching it chooses itself. Both take these defaults and ranges, so there is one schema."""

    # issue 18: the default gives a 'fair' split-half verdict on arith-base (measured, seed 0: 16 x 4
    # samples -> top-1% Jaccard 0.347 'poor', 32 -> 0.479, 64 -> 0.548 'fair'; seeds 1-2 and the
    # command: benchmarks/results/fisher_reliability.json, made by benchmarks/fisher_reliability.py)
    prompts: FisherPrompts = Field(64, description="number of task prompts (64 x 4 samples: split-half "
                                   "verdict 'fair' on arith-base; 16 gave 'poor')")
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
    dtype: Dtype = Field(
        "float32", description="dtype of the forward/backward: float32 on every device by default (sums "
        "are float32 whatever this is); bfloat16/float16 are faster on GPUs and the result states their "
        "error against float32 on the same samples; auto = bfloat16 on CUDA")
    device: Device = "auto"
    memory_budget_mb: int | None = Field(
        None, ge=64, le=1_048_576,
        description="bound on per-sample-gradient temporaries (MiB); None = a quarter of free device memory",
    )


class TrainingKnobs(Spec):
    """The training knobs of every kind that trains (train, sweep, retention), each declared once
    here. A kind that needs another default or description redeclares the field in its own class
    (it keeps its place in the field order)."""

    model: ModelRef
    task: TaskRef = "arithmetic"
    algo: Algo = Field("grpo", description="post-training algorithm")
    teacher: ModelRef | None = Field(None, description="teacher model for opd (same tokenizer)")
    batch: Batch = Field(8, description="prompts per step")
    group: Group = Field(8, description="completions per prompt")
    max_new_tokens: MaxNewTokens = Field(16, description="sampled completion length")
    eval_prompts: int = Field(200, ge=1, le=100_000, description="held-out prompts for greedy accuracy")
    weight_decay: WeightDecay = Field(0.0, description="decoupled weight decay")
    momentum: Momentum = Field(0.0, description="SGD momentum")
    temperature: Temperature = Field(1.0, description="sampling temperature")
    kl_coef: KlCoef = Field(0.0, description="GRPO KL to the reference")
    distill_estimator: DistillEstimator = Field(
        "full", description="OPD reverse KL: exact over the vocabulary, or sampled-token estimate"
    )
    fisher_prompts: FisherPrompts = Field(32, description="prompts of the initial Fisher")
    fisher_samples: FisherSamples = Field(4, description="samples per prompt of the initial Fisher")
    device: Device = "auto"
    gradient_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in backward (transformers' gradient "
        "checkpointing): holds each layer's input instead of all its activations, one more forward per step")


class RunKnobs(TrainingKnobs):
    """The knobs of one training run that train and sweep expose (retention keeps their defaults)."""

    grad_clip: float | None = Field(1.0, gt=0.0, le=1e6, description="max grad norm; None = off")
    clip_eps: ClipEps = Field(0.2, description="GRPO ratio clip")
    sft_source: SftSource = Field("gold",
        description="SFT targets: gold answers or the model's own correct samples")


class LoopKnobs(RunKnobs):
    """The knobs of one training run that only take one value per job (train; retention reads
    them too). The training loop's configuration (compute.train.config.TrainConfig) takes its
    defaults and ranges from here, so the loop never reads a job declaration."""

    optimizer: Optimizer = Field("adamw", description="optimizer of the trained coordinates")
    lr: Lr = Field(
        2e-4, description="AdamW 1e-3 collapses GRPO on arith-base; 2e-4 is stable"
    )
    steps: Steps = Field(30, description="optimizer steps")
    seed: Seed = Field(0, description="seed of prompts, sampling and selectors")
    precision: Precision = Field(
        "fp32", description="fp32 | bf16-mixed (fp32 master weights, bf16 checkpoint) | bf16 (bf16 weights: "
        "updates below half a bf16 ULP are lost)")


# dtypes a model may be loaded in for each training precision (precision sets the training dtype)
PRECISION_DTYPES = {"fp32": ("auto", "float32"), "bf16-mixed": ("auto", "float32", "bfloat16"),
                    "bf16": ("auto", "bfloat16")}


class SpecError(ValueError):
    """A user-facing validation error: `errors` is a list of {field, message}."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


def validate_spec(cls: type[Spec], data: Any) -> Spec:
    """Validate `data` against spec class `cls`; SpecError naming each bad field and its accepted
    range. By kind name: compute.jobs.registry.parse_spec."""
    if not isinstance(data, dict):
        raise SpecError([{"field": "spec", "message": "must be a JSON object"}])
    data = {k.replace("-", "_"): v for k, v in data.items()}
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise SpecError([friendly_error(e, cls) for e in exc.errors()]) from None


def friendly_error(err: Any, cls: type[BaseModel]) -> dict[str, str]:
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
