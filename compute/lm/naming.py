"""Parameter names -> (layer index, module type), across HF architectures. No torch import.

Module types are the rows/columns of every layer x module heatmap:
q, k, v, qkv (fused, GPT-2 c_attn), o, gate, up, down, norm, embed, pos_embed, lm_head, other.
"""

from __future__ import annotations

import re

MODULE_TYPES = ("embed", "pos_embed", "q", "k", "v", "qkv", "o", "gate", "up", "down", "norm", "lm_head", "other")

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")

# Order matters: first match wins. Patterns are matched against the full parameter name.
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pat))
    for kind, pat in (
        ("norm", r"(norm|ln_\w+|ln_f|layernorm|layer_norm)[^.]*\.(weight|bias)$"),
        ("q", r"\.(q_proj|query|q)\.(weight|bias)$"),
        ("k", r"\.(k_proj|key|k)\.(weight|bias)$"),
        ("v", r"\.(v_proj|value|v)\.(weight|bias)$"),
        ("qkv", r"\.(c_attn|qkv_proj|query_key_value|Wqkv|qkv)\.(weight|bias)$"),
        ("o", r"(self_attn|attn|attention)\.(o_proj|c_proj|out_proj|dense|o)\.(weight|bias)$"),
        ("gate", r"\.(gate_proj|w1|gate)\.(weight|bias)$"),
        ("up", r"\.(up_proj|c_fc|fc1|w3|fc_in|dense_h_to_4h)\.(weight|bias)$"),
        ("down", r"(mlp|ffn|feed_forward)\.(down_proj|c_proj|fc2|w2|fc_out|dense_4h_to_h)\.(weight|bias)$"),
        ("pos_embed", r"(wpe|position_embeddings|embed_positions)\.weight$"),
        ("embed", r"(embed_tokens|wte|word_embeddings|tok_embeddings|embed_in)\.weight$"),
        ("lm_head", r"(^|\.)(lm_head|embed_out|output)\.(weight|bias)$"),
    )
)


def layer_index(name: str) -> int | None:
    """Transformer block index of a parameter, or None for embeddings, final norm, lm_head."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def module_type(name: str) -> str:
    """One of MODULE_TYPES for a parameter name (e.g. 'model.layers.3.mlp.up_proj.weight' -> 'up')."""
    for kind, pat in _RULES:
        if pat.search(name):
            return kind
    return "other"


def layer_label(layer: int | None) -> str:
    return "-" if layer is None else str(layer)


def layer_sort_key(label: str) -> tuple[int, int, str]:
    """Order of layer labels: blocks by index, then the named rest (embeddings, final norm, ...)."""
    return (0, int(label), "") if label.isdigit() else (1, 0, label)
