"""Token log-probabilities through the output head a chunk of tokens at a time (issue 30).

A causal LM's logits are (rows, length, vocab) float32: for an 8B Qwen3 (151,936 tokens) a GRPO
step's 8 rows of 1,024 tokens hold 5 GB per copy, and log_softmax, its saved output and the
gradients make three or four copies. The training objectives only need log p(token) of the
tokens that are there, so the logits need never exist whole: the backbone's last hidden states
(rows x length x hidden, small) go through the head `LOGITS_CHUNK_BYTES` of logits at a time, each
chunk's log-probabilities taken as logit[target] - logsumexp(logits) (`_TargetLogprob`: the logits
and one gradient are the only vocab-sized tensors), and
with gradients each chunk is recomputed in backward (activation checkpointing), so one chunk's
logits are alive at any moment. The price is one more pass of the head's matmul in backward.

Only where it is exact: the split is used for a model whose logits are the head applied to the
backbone's last hidden state, nothing after (Gemma 2/3's soft-capping, Cohere's and Granite's
scaling are not), and that is *checked*, not assumed from a list: the first time a model is seen,
one row's logits both ways must agree (`split_head`); a model that fails, or has no
get_decoder / get_output_embeddings, takes the full path (`model(...).logits`) as before.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
import torch.utils.checkpoint

# model -> whether head(backbone(x)) reproduced its logits; checked once per model (the parts are
# looked up each time: masked training swaps a layer's class after the check, not the module)
_EXACT: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
CHECK_TOKENS = 16  # tokens of the one row the split is checked on


def _parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    get_dec, get_out = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if get_dec is None or get_out is None:
        return None
    try:
        dec, head = get_dec(), get_out()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    if not isinstance(dec, torch.nn.Module) or dec is model or not isinstance(head, torch.nn.Linear):
        return None
    return dec, head


def hidden_states(backbone: torch.nn.Module, ids: torch.Tensor, am: torch.Tensor,
                  position_ids: torch.Tensor) -> torch.Tensor:
    """The backbone's last hidden states (N, L, H), no KV cache kept."""
    out = backbone(input_ids=ids, attention_mask=am, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def split_head(model: torch.nn.Module, ids: torch.Tensor, am: torch.Tensor,
               position_ids: torch.Tensor) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(backbone, head) of `model` when head(backbone(x)) is its logits, checked on the first
    row of `ids` (at most CHECK_TOKENS tokens) the first time the model is seen; else None."""
    parts = _parts(model)
    if parts is None or model in _EXACT:
        return parts if _EXACT.get(model) else None
    n = min(CHECK_TOKENS, ids.shape[1])
    a, m, p = ids[:1, :n], am[:1, :n], position_ids[:1, :n]
    try:
        with torch.no_grad():
            full = model(input_ids=a, attention_mask=m, position_ids=p, use_cache=False).logits
            exact = logits_are_head_of(parts[1], hidden_states(parts[0], a, m, p), full)
    except (TypeError, ValueError, RuntimeError, AttributeError):
        exact = False
    _EXACT[model] = exact
    return parts if _EXACT[model] else None


def logits_are_head_of(head: torch.nn.Module, h: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether `logits` are head(h) up to rounding: nothing (soft-capping, a logit scale) sits
    between the last hidden state and the logits. The one test of it: the chunked head here and
    the exact output-layer Fisher (compute.fisher.exact_output) both ask this."""
    ref, got = head(h).float(), logits.float()
    if ref.shape != got.shape:
        return False
    half = logits.dtype in (torch.bfloat16, torch.float16)
    scale = float(ref.abs().max()) + 1e-30
    return bool(torch.allclose(got, ref, rtol=2e-2 if half else 1e-4, atol=(2e-2 if half else 1e-5) * scale))


class _TargetLogprob(torch.autograd.Function):
    """log_softmax(logits)[target] per row, holding the logits and nothing vocab-sized besides:
    backward builds the one gradient in place (softmax, scaled, the target's 1 added), where
    log_softmax + gather would keep its output and make two more vocab-sized tensors."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        lse = torch.logsumexp(logits, -1)
        ctx.save_for_backward(logits, targets, lse)
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        gx = (logits - lse.unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))  # -g softmax
        return gx.scatter_add_(-1, targets.unsqueeze(-1), g.unsqueeze(-1).to(gx.dtype)), None


def target_logprob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., target] (..., ) from logits (..., V) and targets (...,), the
    logits and one gradient the only vocab-sized tensors (the Fisher engine's loss uses it too)."""
    return _TargetLogprob.apply(logits, targets)


def _chunk_logprobs(head: torch.nn.Linear, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return target_logprob(head(h).float(), targets)  # (T,) from one chunk's (T, V) logits


def head_logprobs(head: torch.nn.Linear, h: torch.Tensor, targets: torch.Tensor,
                  chunk_bytes: int | None = None) -> torch.Tensor:
    """log p(targets) (T,) float32 from hidden states h (T, H) through `head`, a chunk of tokens
    at a time. With gradients and more than one chunk, each chunk is checkpointed: its logits are
    recomputed in backward instead of kept."""
    from compute.contract.cost import logits_chunk_tokens

    step = logits_chunk_tokens(int(head.weight.shape[0]), chunk_bytes)
    fn = partial(_chunk_logprobs, head)
    if h.shape[0] <= step:
        return fn(h, targets)
    grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.parameters()))
    outs: list[Any] = []
    for a in range(0, h.shape[0], step):
        hc, tc = h[a : a + step], targets[a : a + step]
        outs.append(torch.utils.checkpoint.checkpoint(fn, hc, tc, use_reentrant=False) if grad else fn(hc, tc))
    return torch.cat(outs)
