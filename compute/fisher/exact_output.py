"""Closed-form Fisher of the output layer (unembedding), a check on the Monte-Carlo estimators.

Valid only when the logits are the output layer applied to the last hidden state. Some families
transform them first (Granite `logits_scaling`, Cohere `logit_scale`, Gemma2 final soft-capping);
the first batch checks head(h) == logits and raises `ExactOutputUnsupported` (with the reason)
instead of returning a closed form of the wrong function.
"""

from __future__ import annotations

import torch
from torch import nn

from compute.lm.device import model_device
from compute.lm.sampling import position_ids_from_mask

_TRANSFORM_HINTS = ("logits_scaling", "logit_scale", "final_logit_softcapping", "output_multiplier")


class ExactOutputUnsupported(ValueError):
    """The closed-form output-layer Fisher does not apply to this model (message: why)."""


def _output_layer(model: nn.Module) -> tuple[nn.Module, torch.Tensor, str, str | None]:
    """(head, its weight, the weight's parameter name, the bias's or None)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Module) or not isinstance(weight, torch.Tensor):
        raise ExactOutputUnsupported("model: has no output embedding (unembedding) layer")
    by_id = {id(p): n for n, p in model.named_parameters()}
    w_name = by_id[id(weight)]
    b = getattr(head, "bias", None)
    return head, weight, w_name, (by_id[id(b)] if b is not None else None)


def _check_plain_head(model: nn.Module, head: nn.Module, h: torch.Tensor,
                      logits: torch.Tensor) -> None:
    """Raise ExactOutputUnsupported unless logits == head(h) (up to rounding)."""
    from compute.lm.head import logits_are_head_of

    if logits_are_head_of(head, h, logits):
        return
    cfg = getattr(model, "config", None)
    found = [f"{k}={getattr(cfg, k)}" for k in _TRANSFORM_HINTS
             if getattr(cfg, k, None) not in (None, 1, 1.0)]
    raise ExactOutputUnsupported(
        f"model: the logits of {type(model).__name__} are not the output layer applied to the "
        "last hidden state (a transform sits between them"
        + (f": {', '.join(found)}" if found else "")
        + "), so the closed-form output-layer Fisher does not apply; skipped")


@torch.no_grad()
def exact_output_fisher(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, normalize: str = "sequence", batch_size: int = 8,
) -> dict[str, torch.Tensor]:
    """Closed-form Fisher of the unembedding W (V, d) on the given prefixes, no sampling.

    For each counted position t (token t in the completion, predicted from h_{t-1}):
    F_t[v, :] = p_t[v] (1 - p_t[v]) h_t^2, and p(1 - p) for a bias. normalize="sequence": sum
    over positions, mean over rows (the limit of the `sequence` estimator, whose cross-position
    terms vanish in expectation); "token": mean over positions (the `token` estimator's limit).
    With tied embeddings this is the Fisher of the output use of W only. Left or right padding.
    Returns {W name: (V, d) float32, [bias name: (V,)]} on CPU. Raises ExactOutputUnsupported
    when the logits are not head(h) (logit scaling, soft-capping).
    """
    if normalize not in ("sequence", "token"):
        raise ValueError(f"normalize: got {normalize!r}; accepted: sequence, token")
    head, weight, w_name, b_name = _output_layer(model)
    device = model_device(model)
    V = weight.shape[0]
    fw = torch.zeros(weight.shape, dtype=torch.float64, device=device)
    fb = torch.zeros((V,), dtype=torch.float64, device=device) if b_name else None
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda m, a, o: captured.append(a[0].detach()))
    n_pos = 0
    try:
        for s in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[s : s + batch_size].to(device)
            am = attention_mask[s : s + batch_size].to(device)
            cm = completion_mask[s : s + batch_size].to(device).bool()
            captured.clear()
            logits = model(input_ids=ids, attention_mask=am,
                           position_ids=position_ids_from_mask(am), use_cache=False).logits
            if s == 0:
                _check_plain_head(model, head, captured[-1], logits)
            h = captured[-1][:, :-1].double()  # (b, L-1, d)
            sel = cm[:, 1:]  # positions predicting a counted token
            pv = logits[:, :-1].double().softmax(-1)[sel]  # (P, V)
            a = pv * (1 - pv)  # (P, V)
            fw += a.T @ h[sel].square()  # (V, d)
            if fb is not None:
                fb += a.sum(0)
            n_pos += int(sel.sum())
    finally:
        handle.remove()
    denom = input_ids.shape[0] if normalize == "sequence" else max(1, n_pos)
    out = {w_name: (fw / denom).float().cpu()}
    if fb is not None and b_name:
        out[b_name] = (fb / denom).float().cpu()
    return out
