"""Loading causal LMs and choosing device/dtype: `load_model`, the one loader every job uses.

A model is a resolved `Ref` (compute.contract.kinds; the worker and the CLI pass the one the
resolver made at validation, read where it is, no second resolution) or, for library callers,
a name (zoo, a folder inside the allowed roots, a hub id; compute.contract.modelref).

`trust_remote_code` follows the operator's setting (`Settings.trust_remote_code`, env
TRUST_REMOTE_CODE=1), off by default; submit already refused a model whose config.json asks for
its own code (`auto_map`) while it is off (app.services.refs), so a job never gets here with one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from compute.contract.kinds import Ref
from compute.contract.modelref import is_hub_id, resolve_model

# every device/dtype decision lives in compute.lm.device (resolve_dtype is re-exported for callers)
from compute.lm.device import resolve_device, resolve_dtype


@contextlib.contextmanager
def _construction_checkpoints() -> Iterator[None]:
    """A cancel point at every submodule and parameter the model's construction registers
    (torch's global registration hooks, removed afterwards): a cancel stops a model with a
    million layers while it is being built, not after. transformers 5 builds from_pretrained's
    model on the meta device (PreTrainedModel.get_init_context), so construction itself holds no
    weights; the weights come from the files checked at submit. The test-only fault point
    `constructing` stops at the first registration."""
    from torch.nn.modules import module as nn_module

    from compute.runtime.control import cancel_point, fault_point

    def check(*_args: Any) -> None:
        fault_point("constructing")
        cancel_point()  # throttled: a flag read at most every few seconds

    handles = [nn_module.register_module_module_registration_hook(check),
               nn_module.register_module_parameter_registration_hook(check)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def load_model(
    model: Ref | str,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool | None = None,
    settings: Any | None = None,
    progress: Any | None = None,
) -> tuple[Any, Any]:
    """(model.eval(), tokenizer) for a resolved Ref, or a zoo name, an allowed local HF
    directory or a hub id. `trust_remote_code` None: the operator's setting.

    The tokenizer always has a pad token (eos when the model defines none); padding side is
    right. ValueError "model: ..." for unknown references and models that cannot be loaded.
    progress(fraction, message), if given, hears each loading stage (tokenizer, weights with
    their size, device) at fraction 0: a job's status line says what it waits for.
    """
    report = progress or (lambda fraction, message: None)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if settings is None:
        from compute.contract.settings import get_settings

        settings = get_settings()
    if isinstance(model, Ref):
        resolved, name_or_path = model.where(), model.given
    else:
        resolved, name_or_path = resolve_model(model, settings), model
    hub = is_hub_id(resolved)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    trust = settings.trust_remote_code if trust_remote_code is None else trust_remote_code
    kwargs: dict[str, Any] = {"trust_remote_code": bool(trust)}
    if not hub or settings.offline:
        kwargs["local_files_only"] = True
    from compute.runtime.control import cancel_point, fault_point

    cancel_point()
    fault_point("loading", str(name_or_path))  # tests only (compute.runtime.control)
    try:
        report(0.0, f"loading the tokenizer of {name_or_path}")
        tokenizer = AutoTokenizer.from_pretrained(resolved, **kwargs)
        report(0.0, f"loading the weights of {name_or_path}{_weights_size(resolved)}")
        with _construction_checkpoints():
            lm: Any = AutoModelForCausalLM.from_pretrained(resolved, dtype=dt, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if hub:
            raise ValueError(
                f"model: could not load {name_or_path!r} from the hub (no network?): {first}"
            ) from None
        raise ValueError(f"model: could not load {name_or_path!r}: {first}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"model: tokenizer of {name_or_path!r} has neither a pad nor an eos token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    if getattr(lm.config, "pad_token_id", None) is None:
        lm.config.pad_token_id = tokenizer.pad_token_id
    if dev.type != "cpu":
        report(0.0, f"moving {name_or_path} to {dev}")
    lm.to(dev)
    lm.eval()
    cancel_point()  # a job cancelled while its model loaded stops here, before any sampling
    return lm, tokenizer


def _weights_size(resolved: Any) -> str:
    """' (270 MB)': the size of a local folder's weight files ('' for hub ids)."""
    try:
        folder = Path(str(resolved))
        total = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0
        total = total or (sum(f.stat().st_size for f in folder.glob("*.bin")) if folder.is_dir() else 0)
    except OSError:
        return ""
    if not total:
        return ""
    mb = total / 1e6  # two significant digits below 10 MB: a zoo model is 0.44 MB, not "0 MB"
    return f" ({mb:.0f} MB)" if mb >= 10 else f" ({mb:.2g} MB)"


def greedy_generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    max_new_tokens: int = 8,
    batch_size: int = 256,
) -> list[str]:
    """Greedy completions (decoded, special tokens dropped), stopping each row at eos.

    Batched with left padding and a KV cache (compute.lm.sampling's one generation loop); position
    ids are passed explicitly, so left padding is safe for Qwen3, Llama and GPT-2.
    """
    from compute.lm.sampling import greedy_completions

    return greedy_completions(model, tokenizer, prompts, max_new_tokens, batch_size)


def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    task: Any,
    n: int = 200,
    split: str = "test",
    seed: int = 0,
    max_new_tokens: int = 8,
    batch_size: int = 256,
    start: int = 0,
) -> float:
    """Mean task reward of greedy completions on `n` prompts of `split` (task: Task or name)."""
    from compute.lm.verifiable_tasks import get_task

    if isinstance(task, str):
        task = get_task(task)
    examples = task.examples(n, seed=seed, split=split, start=start)
    if not examples:
        return 0.0
    completions = greedy_generate(
        model, tokenizer, [e.prompt for e in examples], max_new_tokens, batch_size
    )
    rewards = [task.reward(c, e.answer) for c, e in zip(completions, examples, strict=True)]
    return sum(rewards) / len(rewards)


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
