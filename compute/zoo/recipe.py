"""How the zoo models are built: the recipe (architecture + SFT schedule) and the families."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from compute.contract.modelref import ZOO_NAMES


@dataclass(frozen=True)
class ZooRecipe:
    """How the zoo models are built (recorded in each model's fisherlens.json)."""

    hidden_size: int = field(default=64, metadata={"help": "model width"})
    num_layers: int = field(default=2, metadata={"help": "transformer blocks"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    num_kv_heads: int = field(default=2, metadata={"help": "key/value heads (GQA)"})
    intermediate_size: int = field(default=192, metadata={"help": "MLP width"})
    batch_size: int = field(default=128, metadata={"help": "SFT sequences per step"})
    lr: float = field(
        default=3e-3, metadata={"help": "AdamW learning rate (constant after warmup)"}
    )
    warmup_steps: int = field(default=20, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    eval_every: int = field(default=25, metadata={"help": "steps between validation checks"})
    val_prompts: int = field(
        default=256, metadata={"help": "validation prompts (held-out part of train)"}
    )
    test_prompts: int = field(
        default=500, metadata={"help": "held-out test prompts for the record"}
    )
    base_target: float = field(default=0.25, metadata={"help": "val accuracy that stops the base"})
    base_max_steps: int = field(default=1500, metadata={"help": "cap on steps to the base"})
    teacher_steps: int = field(
        default=1000, metadata={"help": "steps after the base, cosine-decayed LR"}
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.base_target < 1.0:
            raise ValueError(f"base_target: {self.base_target} must be in (0, 1)")
        if self.eval_every < 1 or self.base_max_steps < self.eval_every:
            raise ValueError("eval_every: need 1 <= eval_every <= base_max_steps")
        if self.teacher_steps < self.eval_every:
            raise ValueError("teacher_steps: need teacher_steps >= eval_every")


def build_model(tokenizer: Any, recipe: ZooRecipe, seed: int) -> Any:
    """Randomly initialised Qwen3 causal LM (deterministic given seed)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.hidden_size // recipe.num_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    return model


DEEP_RECIPE = ZooRecipe(num_layers=8)
# family -> (recipe, base name, teacher name). One SFT run per family gives both checkpoints.
FAMILIES: dict[str, tuple[ZooRecipe, str, str]] = {
    "arith": (ZooRecipe(), "arith-base", "arith-teacher"),
    "arith-deep": (DEEP_RECIPE, "arith-deep-base", "arith-deep-teacher"),
}


def family_of(name: str) -> str:
    for fam, (_, base, teacher) in FAMILIES.items():
        if name in (base, teacher):
            return fam
    raise ValueError(f"names: unknown zoo model {name!r}; accepted: {', '.join(ZOO_NAMES)}")
