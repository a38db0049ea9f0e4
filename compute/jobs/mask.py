"""The `mask` job kind: a parameter mask from a Fisher, weights or gradients (compute/jobs/mask_run.py).

Declares the spec, the typed result and its contract, the cost and `KIND`; figures and key numbers
are in app/figures/mask.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from compute.contract.cost import (
    COST_PROMPT_TOKENS,
    FILE_JOB_CALLS,
    MASK_CALLS_PER_ELEMENT,
    MASK_SELECT_CALLS,
    Sizing,
    file_memory,
)
from compute.contract.kinds import JobKind, KindForm, TensorView
from compute.contract.results import Contract, Summary, TypedResult
from compute.contract.specs import (
    AllowOtherModel,
    Device,
    ModelRef,
    Seed,
    Selector,
    Spec,
    TaskRef,
)

# ---------------------------------------------------------------- spec


class MaskSpec(Spec):
    fisher: str | None = Field(
        None, max_length=1000, description="fisher.safetensors path or 'job:<id>' of a fisher job"
    )
    allow_other_model: AllowOtherModel = False
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


# ---------------------------------------------------------------- result



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


class MaskResult(TypedResult[MaskSummary]):
    kind: Literal["mask"]


CONTRACT = Contract("mask", MaskResult, heatmaps=("mask_density",), groups=("tensor",))


# ---------------------------------------------------------------- the kind


def cost(s: MaskSpec) -> int:
    """Only the gradient selector runs the model (one backward per prompt's gold answer)."""
    return s.prompts * (COST_PROMPT_TOKENS + 16) * 3 if s.select == "gradient" else 0


def timing(s: MaskSpec, z: Sizing) -> dict[str, float]:
    """Reading the Fisher and selecting (a pass over its elements); the gradient selector also
    loads the model and runs one backward per prompt."""
    out = {"select": z.calls_s(FILE_JOB_CALLS + MASK_SELECT_CALLS + MASK_CALLS_PER_ELEMENT * max(z.data_elements, z.params))}
    if s.select == "gradient":
        out["gradient"] = z.load_s() + z.calls_s(s.prompts) + z.passes_s(cost(s))
    return out


def memory(s: MaskSpec, z: Sizing) -> dict[str, float]:
    return file_memory(z, models=1 if s.select in ("gradient", "magnitude") else 0)


KIND = JobKind(
    name="mask", title="Mask", spec=MaskSpec, contract=CONTRACT, runner="compute.jobs.mask_run:run",
    cost=cost, order=20, timing=timing, memory=memory,
    refs={"model": "model", "fisher": "fisher", "gradient": "gradient"},
    outputs={"mask": "mask"},
    form=KindForm(tab="Mask", button="Build mask", cost=False,
                  main=("fisher", "select", "density", "model", "seed")),
    example={"fisher": "job:1", "density": 0.05},
    tensors=TensorView(value="mask (1 = kept)", artifact="mask", pool="mean", log=False, config_field="model", sets=True),
)
