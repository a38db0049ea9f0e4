"""The `tokens` job kind: the next tokens after a context, their parameter sensitivities and
shares of the Fisher (compute/jobs/tokens_run.py). It has no New job form: the explorer's Token
explorer tab (app/ui/tokens.py) submits it.

Declares the spec, the typed result and its contract, the cost and `KIND`; figures and key numbers
are in app/figures/tokens.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from compute.contract.cost import RUNTIME_BASE_MB, TOKEN_GRAD_CALLS, TOKEN_SETUP_CALLS, Sizing
from compute.contract.kinds import JobKind
from compute.contract.results import Contract, Row, Summary, TypedResult
from compute.contract.specs import (
    Device,
    Dtype,
    ModelRef,
    Seed,
    Spec,
)

# ---------------------------------------------------------------- spec


class TokensSpec(Spec):
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


# ---------------------------------------------------------------- result

TOKEN_SETS = ("top", "random", "low")
SIMILARITY = {w: f"similarity_{w}" for w in TOKEN_SETS}


class TokenRow(Row):
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


class TokensResult(TypedResult[TokensSummary]):
    kind: Literal["tokens"]


CONTRACT = Contract("tokens", TokensResult, heatmaps=tuple(SIMILARITY.values()), groups=("tensor",))


# ---------------------------------------------------------------- the kind


def cost(s: TokensSpec) -> int:
    length = len(s.context)  # characters: at least the number of tokens
    grads = s.top_k + s.random_k + s.low_k + s.max_tokens
    return length * (1 + 3 * grads)


def timing(s: TokensSpec, z: Sizing) -> dict[str, float]:
    """Load, then the sensitivities: a forward over the context and the factored-gradient check,
    and one backward per traced token (its fixed part and its arithmetic over the context). Two
    parts, as the job reports its time (tokens_run: `summary.seconds_parts`)."""
    grads = s.top_k + s.random_k + s.low_k + min(s.max_tokens, z.vocab)
    return {"load": z.load_s(),
            "sensitivities": z.calls_s(TOKEN_SETUP_CALLS + grads * TOKEN_GRAD_CALLS) + z.passes_s(cost(s))}


def memory(s: TokensSpec, z: Sizing) -> dict[str, float]:
    return {"runtime": RUNTIME_BASE_MB * 2**20, "weights": 4.0 * z.params,
            "gradients": 8.0 * z.params + z.activation_bytes(len(s.context))}


KIND = JobKind(
    name="tokens", title="Token explorer", spec=TokensSpec, contract=CONTRACT, runner="compute.jobs.tokens_run:run",
    cost=cost, order=70, timing=timing, memory=memory,
    refs={"model": "model"},
    example={"model": "arith-base", "context": "12+34="},
)
