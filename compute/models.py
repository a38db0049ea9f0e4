"""Loading causal LMs (zoo name, local HF directory, or hub id) and choosing device/dtype.

`trust_remote_code` is off unless the caller passes True. Callers must only pass True when the
operator opted in (`Settings.trust_remote_code`, env TRUST_REMOTE_CODE=1); this module never
reads the setting itself, so a library user cannot switch it on by accident.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from compute.modelref import is_hub_id, resolve_model

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """"auto"/None: env FISHERLENS_DEVICE if set, else cuda if available, else cpu."""
    if isinstance(device, torch.device):
        return device
    if device in (None, "", "auto"):
        device = os.environ.get("FISHERLENS_DEVICE") or None
        if device in (None, "auto"):
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: {device!r} is not a device; accepted: auto, cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available; use auto or cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str | None = None) -> torch.dtype:
    """"auto"/None: bfloat16 on a CUDA device that supports it, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        dev = resolve_device(device) if not isinstance(device, torch.device) else device
        if dev.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not accepted; accepted: auto, float32, bfloat16, float16")
    return _DTYPES[dtype]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or os.environ.get(
        "TRANSFORMERS_OFFLINE", "0"
    ).lower() in ("1", "true", "yes")


def load_model(
    name_or_path: str,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    settings: Any | None = None,
) -> tuple[Any, Any]:
    """(model.eval(), tokenizer) for a zoo name, an allowed local HF directory, or a hub id.

    The tokenizer always has a pad token (eos when the model defines none); padding side is
    right. ValueError "model: ..." for unknown references and models that cannot be loaded.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_model(name_or_path, settings)
    hub = is_hub_id(resolved)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    kwargs: dict[str, Any] = {"trust_remote_code": bool(trust_remote_code)}
    if not hub or _offline():
        kwargs["local_files_only"] = True
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=dt, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if hub:
            raise ValueError(
                f"model: could not load {name_or_path!r} from the hub (no network?): {first}"
            ) from None
        raise ValueError(f"model: could not load {name_or_path!r} from {resolved}: {first}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"model: tokenizer of {name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.to(dev)
    model.eval()
    return model, tokenizer


def model_info(model: Any) -> dict[str, Any]:
    """Architecture name, parameter count, layers, vocabulary and hidden sizes."""
    cfg = model.config
    archs = getattr(cfg, "architectures", None) or [type(model).__name__]
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    return {
        "architecture": archs[0],
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_layers": int(n_layers) if n_layers is not None else None,
        "vocab_size": int(getattr(cfg, "vocab_size", 0) or 0),
        "hidden_size": int(hidden) if hidden is not None else None,
    }
