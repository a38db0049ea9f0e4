"""Every causal-LM class of the installed transformers, built tiny from its own config class.

`causal_lm_classes()` lists transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (model type -> class
name) plus the causal-LM classes known to have been refused badly (EXTRA). `tiny_model(name)`
builds one with generic small sizes (hidden 16, 2 layers, 2 heads, vocab VOCAB ...), or raises
`CannotBuildTiny` with the reason (needs a checkpoint or remote code, a config that rejects small
sizes, still large with them). Used by tests/unit/test_arch_all.py.

`python -m tests.unit.arch_all` prints one line per class: exact (worst error) / refused
(reason) / skipped (reason) / FAIL (another exception) / WRONG (an error above TOL).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import torch

from tests.unit.fisher_tiny import VOCAB

# float32 engine vs float64 reference: noise stays below ~2e-5 relative L1 on every class seen;
# a structural error (another model's function, a missing term) is >= 1e-1
TOL = 1e-4
MAX_PARAMS = 400_000  # "tiny": a brute-force reference must take well under a second

H, FF, HEAD = 16, 32, 8
TINY: dict[str, Any] = {
    # widths
    "hidden_size": H, "n_embd": H, "d_model": H, "dim": H, "embed_dim": H, "n_embed": H,
    "intermediate_size": FF, "ffn_dim": FF, "n_inner": FF, "d_ff": FF, "dff": FF,
    "decoder_ffn_dim": FF, "encoder_ffn_dim": FF, "ffn_hidden_size": FF,
    "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8, "expert_intermediate_size": 8,
    "head_dim": HEAD, "kv_channels": HEAD, "attention_head_size": HEAD,
    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": HEAD, "kv_lora_rank": 8,
    "q_lora_rank": 8, "rotary_dim": 4, "partial_rotary_factor": 0.5,
    "backbone_hidden_size": H, "num_codebooks": 4,
    "lru_width": H, "conv1d_width": 3, "conv_kernel": 3, "state_size": 4, "d_state": 4,
    "ssm_state_size": 4, "mamba_d_state": 4, "mamba_d_conv": 3, "mamba_expand": 2,
    "mamba_n_heads": 2, "mamba_d_head": 16, "time_step_rank": 4, "expand": 2,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": HEAD,
    "linear_value_head_dim": HEAD, "linear_conv_kernel_dim": 3,
    "block_size": 4, "window_size": 4, "sliding_window": 4, "attention_window_size": 4,
    "local_attention": 4,
    # depths
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2, "num_decoder_layers": 2,
    # heads
    "num_attention_heads": 2, "n_head": 2, "num_heads": 2, "n_heads": 2, "attention_heads": 2,
    "decoder_attention_heads": 2, "encoder_attention_heads": 2, "num_key_value_heads": 1,
    "n_kv_heads": 1, "num_kv_heads": 1, "multi_query_group_num": 1,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    # positions and vocabulary
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
    "max_sequence_length": 64, "vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 1, "decoder_start_token_id": 1, "tie_word_embeddings": False,
    "is_decoder": True, "use_cache": False,
}
DROPOUT_KEYS = ("attn_pdrop", "embd_pdrop", "resid_pdrop", "dropout", "attention_dropout",
                "hidden_dropout", "activation_dropout", "hidden_dropout_prob",
                "attention_probs_dropout_prob", "summary_first_dropout", "ffn_dropout")
# causal-LM classes outside the auto mapping that were found refusing with the wrong exception
EXTRA = ("CsmDepthDecoderForCausalLM", "Mistral4ForCausalLM")


class CannotBuildTiny(Exception):
    """This class cannot be built tiny here (the message says why)."""


def causal_lm_classes() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = list(dict.fromkeys(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()))
    return names + [n for n in EXTRA if n not in names]


def _layer_lists(defaults: Any, layers: int) -> dict[str, Any]:
    """List-valued per-layer fields (layer_types, block_types, ...) cut to `layers` entries."""
    n = getattr(defaults, "num_hidden_layers", None)
    out = {}
    for k, v in vars(defaults).items():
        if isinstance(v, list) and n and len(v) == n and not k.endswith("_token_id"):
            out[k] = v[:layers]
    return out


def _has(obj: Any, key: str) -> bool:
    """hasattr that also says no for attributes whose access raises something else (heterogeneous
    per-layer configs raise on global access)."""
    try:
        return hasattr(obj, key)
    except Exception:  # noqa: BLE001
        return False


def tiny_config(cls: type) -> Any:
    cfg_cls = getattr(cls, "config_class", None)
    if cfg_cls is None:
        raise CannotBuildTiny("no config_class")
    try:
        defaults = cfg_cls()
    except Exception as exc:  # noqa: BLE001 - a config that needs arguments
        raise CannotBuildTiny(f"{cfg_cls.__name__}() needs arguments ({type(exc).__name__})") from None
    kw = {k: v for k, v in TINY.items() if _has(defaults, k)}
    kw.update(_layer_lists(defaults, 2))
    if "qk_rope_head_dim" in kw and "head_dim" in kw:  # MLA: rotary head dim = head_dim
        kw["head_dim"] = kw["qk_rope_head_dim"]
    cfg = None
    for retry in ({}, {"num_key_value_heads": 2}):  # e.g. DiffLlama needs an even kv count
        try:
            cfg = cfg_cls(**{**kw, **{k: v for k, v in retry.items() if k in kw}})
            break
        except Exception as exc:  # noqa: BLE001
            err = exc
    if cfg is None:
        raise CannotBuildTiny(f"{cfg_cls.__name__} rejects small sizes "
                              f"({type(err).__name__}: {str(err)[:120]})")
    for k in DROPOUT_KEYS:
        if _has(cfg, k) and isinstance(getattr(cfg, k, None), float):
            setattr(cfg, k, 0.0)
    for sub in ("text_config", "decoder"):
        if _has(cfg, sub) and not isinstance(getattr(cfg, sub), (int, bool)) \
                and getattr(cfg, sub) is not None:
            raise CannotBuildTiny(f"composite config ({sub}): not a plain causal LM")
    return cfg


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random float32 model of class `name` in eval mode, weights ~ N(0, 0.3^2)."""
    import transformers

    try:
        cls = getattr(transformers, name)
    except Exception as exc:  # noqa: BLE001 - missing optional dependency
        raise CannotBuildTiny(f"cannot import {name} ({type(exc).__name__}: {str(exc)[:100]})") from None
    try:
        cfg = tiny_config(cls)
    except CannotBuildTiny:
        raise
    except Exception as exc:  # noqa: BLE001 - any config trouble means "not tiny here"
        raise CannotBuildTiny(f"config of {name}: {type(exc).__name__}: {str(exc)[:120]}") from None
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            with torch.device("meta"):  # count first: some defaults allocate gigabytes
                n = sum(p.numel() for p in cls(cfg).parameters())
            if n > MAX_PARAMS:
                raise CannotBuildTiny(f"still {n:,} parameters with the generic small sizes")
            torch.manual_seed(seed)
            model = cls(cfg)
    except CannotBuildTiny:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CannotBuildTiny(f"{name}({type(cfg).__name__}) fails with small sizes "
                              f"({type(exc).__name__}: {str(exc)[:120]})") from None
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.float().eval()


def check_class(name: str) -> dict[str, Any]:
    """{"status": exact | refused | skipped | FAIL, "detail"}: the engine on right- and
    left-padded rows (sequence estimator) against the float64 brute force."""
    from compute.fisher import UnsupportedModel, fisher_from_samples
    from tests.unit.test_arch_matrix import _rows, reference, worst_error

    try:
        model = tiny_model(name)
    except CannotBuildTiny as exc:
        return {"status": "skipped", "detail": str(exc)}
    ids, am, cm = _rows(False)
    try:
        model(input_ids=ids[:1, :3])  # the plain unpadded forward must run for a reference
    except Exception as exc:  # noqa: BLE001
        return {"status": "skipped", "detail": f"the tiny model's own forward fails "
                                               f"({type(exc).__name__}: {str(exc)[:100]})"}
    worst = 0.0
    where = ""
    refs = None
    for left in (False, True):
        rows = _rows(left)
        try:
            got = fisher_from_samples(model, *rows, estimator="sequence", batch_size=2)
        except UnsupportedModel as exc:
            return {"status": "refused", "detail": str(exc)}
        except Exception as exc:  # noqa: BLE001 - what the test forbids
            return {"status": "FAIL", "detail": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if refs is None:
            try:
                refs = reference(model, ids, am, cm)["sequence"]
            except Exception as exc:  # noqa: BLE001
                return {"status": "skipped", "detail": f"brute-force reference fails "
                                                       f"({type(exc).__name__}: {str(exc)[:100]})"}
        err, n = worst_error(got, refs)
        if err > worst:
            worst, where = err, f"left={left} {n}"
    status = "exact" if worst <= TOL else "WRONG"  # a number that is not exact: what must never happen
    return {"status": status, "detail": f"{worst:.2e} {where}", "worst": worst}


def main() -> None:
    import sys
    import time

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    names = sys.argv[1:] or causal_lm_classes()
    for name in names:
        t0 = time.perf_counter()
        r = check_class(name)
        detail = " ".join(r["detail"].split())[:200]
        print(f"{name}\t{r['status']}\t{time.perf_counter() - t0:.2f}s\t{detail}", flush=True)


if __name__ == "__main__":
    main()
