"""The training loop's configuration, derived from the user-facing spec by one function
(`TrainConfig.from_spec`).

Every knob a user can set is a spec field (compute.contract.specs.LoopKnobs and the knobs it
inherits; compute/jobs/train.py's TrainSpec is one of them): its default, range and help live
there only, and `TrainConfig` takes them from it (`TrainConfig.from_spec`, or the spec's defaults). The few knobs
no spec exposes (Adam betas, GRPO inner steps, loss aggregation, evaluation cadence) are declared
here, once. Each algorithm's objective (compute.train.objectives) reads the fields it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from compute.contract.spec_fields import describe_fields
from compute.contract.specs import LoopKnobs
from compute.train.objectives.base import AGGREGATIONS

_SPEC = {f.name: f for f in describe_fields(LoopKnobs)}
ALGOS: tuple[str, ...] = _SPEC["algo"].choices or ()
OPTIMIZERS: tuple[str, ...] = _SPEC["optimizer"].choices or ()
PRECISIONS: tuple[str, ...] = _SPEC["precision"].choices or ()


def _spec(name: str) -> Any:
    """A field whose default (and accepted values, checked in __post_init__) is TrainSpec's."""
    return field(default=_SPEC[name].default, metadata={"spec": True, "help": _SPEC[name].help})


@dataclass
class TrainConfig:
    algo: str = _spec("algo")
    optimizer: str = _spec("optimizer")
    lr: float = _spec("lr")
    weight_decay: float = _spec("weight_decay")
    momentum: float = _spec("momentum")
    steps: int = _spec("steps")
    batch: int = _spec("batch")
    group: int = _spec("group")
    seed: int = _spec("seed")
    max_new_tokens: int = _spec("max_new_tokens")
    temperature: float = _spec("temperature")
    grad_clip: float | None = _spec("grad_clip")
    clip_eps: float = _spec("clip_eps")
    kl_coef: float = _spec("kl_coef")
    distill_estimator: str = _spec("distill_estimator")
    sft_source: str = _spec("sft_source")
    eval_prompts: int = _spec("eval_prompts")
    precision: str = _spec("precision")
    gradient_checkpointing: bool = _spec("gradient_checkpointing")
    # not user-facing (no spec field): declared here only
    beta1: float = field(default=0.9, metadata={"help": "AdamW first-moment decay"})
    beta2: float = field(default=0.999, metadata={"help": "AdamW second-moment decay"})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW denominator epsilon"})
    scale_std: bool = field(default=True, metadata={"help": "GRPO: divide advantages by group std"})
    inner_steps: int = field(default=1, metadata={"help": "GRPO updates per sampled batch"})
    aggregation: str = field(default="token", metadata={"help": "loss mean over 'token' or 'sequence'"})
    eval_every: int = field(default=0, metadata={"help": "greedy eval every k steps (0 = before/after)"})
    eval_max_new_tokens: int = field(default=8, metadata={"help": "greedy eval completion cap"})
    track_gradients: bool = field(
        default=False, metadata={"help": "accumulate per-coordinate sum g^2 and sum |g| of the (masked, "
                                 "unclipped) training gradient over all updates"})

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata.get("spec"):
                _check(f.name, getattr(self, f.name))
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1/beta2: got {self.beta1}, {self.beta2}; each must be in [0, 1)")
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps: got {self.inner_steps}; accepted range: >= 1")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation: got {self.aggregation!r}; accepted: {', '.join(AGGREGATIONS)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every: got {self.eval_every}; accepted range: >= 0")

    @classmethod
    def from_spec(cls, spec: Any, **over: Any) -> TrainConfig:
        """The config of a spec (TrainSpec, or any spec sharing field names, e.g. RetentionSpec):
        every config field the spec has, then `over`. A spec without a precision field that loads
        the weights in bfloat16 trains them in bf16 (the weights are kept as loaded)."""
        names = {f.name for f in fields(cls)}
        kw = {n: getattr(spec, n) for n in type(spec).model_fields if n in names}
        if "precision" not in kw and getattr(spec, "dtype", "auto") == "bfloat16":
            kw["precision"] = "bf16"
        return cls(**{**kw, **over})


def _check(name: str, value: Any) -> None:
    """The spec's own accepted values (choices and range) for a config field."""
    info = _SPEC[name]
    if value is None and info.optional:
        return
    if info.choices and value not in info.choices:
        raise ValueError(f"{name}: got {value!r}; accepted: {', '.join(map(str, info.choices))}")
    ops = {"ge": float.__ge__, "gt": float.__gt__, "le": float.__le__, "lt": float.__lt__}
    if info.bounds and not all(ops[k](float(value), float(v)) for k, v in info.bounds.items()):
        raise ValueError(f"{name}: got {value!r}; accepted range: {info.range_text()}")
