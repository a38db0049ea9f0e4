"""On-policy sampling and per-token log-probabilities, with our own KV-cache loop.

Why our own loop: the Fisher is an expectation under the model's own distribution, so sampling
must be exactly softmax(logits / temperature) with nothing else applied (no repetition penalty,
no default top-k from a generation_config), and it must be reproducible row by row. Every row's
randomness comes from its own torch.Generator seeded from (seed, prompt index, sample index), so
a row's completion does not depend on the batch size or on which other prompts share the batch
(sharded Fisher jobs give the same samples on 1 worker or 2).

Layout: during generation prompts are left-padded (so the next token is always at the last
column); the returned `Rollout` is repacked right-padded: prompt tokens, then the completion
(including eos when the row stopped), then padding.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compute.lm.device import model_device
from compute.runtime.control import cancel_point, fault_point

_MASK63 = (1 << 63) - 1


@dataclass
class Rollout:
    """Right-padded token rows. N = number of rows, L = longest row.

    input_ids: (N, L) long; attention_mask: (N, L) long (1 = real token);
    completion_mask: (N, L) bool (tokens whose log-prob counts: the completion, incl. eos);
    prompt_index: (N,) long, index into `prompts` of each row; completions: decoded text per row
    (special tokens stripped); lengths: of sampled rows, (tokens generated, ended with eos) per
    row as sampled (None for gold rows; a sub-rollout keeps none: they describe the sampling).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    prompt_index: torch.Tensor
    prompts: list[str]
    completions: list[str]
    lengths: list[tuple[int, bool]] | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> Rollout:
        return Rollout(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.completion_mask.to(device),
            self.prompt_index.to(device),
            list(self.prompts),
            list(self.completions),
            None if self.lengths is None else list(self.lengths),
        )

    def select(self, rows: torch.Tensor | Sequence[int]) -> Rollout:
        """A sub-rollout of the given rows (trailing all-pad columns trimmed)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        am = self.attention_mask[idx.to(self.attention_mask.device)]
        width = int(am.sum(1).max().item()) if len(idx) else 0
        dev = self.input_ids.device
        return Rollout(
            self.input_ids[idx.to(dev)][:, :width],
            am[:, :width],
            self.completion_mask[idx.to(dev)][:, :width],
            self.prompt_index[idx.to(self.prompt_index.device)],
            list(self.prompts),
            [self.completions[i] for i in idx.tolist()],
        )


def _pad_id(tokenizer) -> int:
    for tok_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tok_id is not None:
            return int(tok_id)
    return 0


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """Deterministic 63-bit seed of one sampled row (splitmix64 of the three integers)."""
    x = (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index) & (
        (1 << 64) - 1
    )
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


def _row_uniforms(keys: list[tuple[int, int]], seed: int, steps: int) -> torch.Tensor:
    """(B, steps) float64 uniforms in [0, 1), one torch.Generator per row."""
    out = torch.empty(len(keys), steps, dtype=torch.float64)
    for i, (p, s) in enumerate(keys):
        gen = torch.Generator(device="cpu").manual_seed(row_seed(seed, p, s))
        out[i] = torch.rand(steps, generator=gen, dtype=torch.float64)
    return out


def filter_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Sampling distribution (B, V) float32 from logits (B, V): softmax(logits / T), then top-k and
    nucleus (top-p) truncation if asked, renormalised."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_k is not None and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p is not None and top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1) / sorted_p.sum(-1, keepdim=True)
        # keep a token if the mass strictly before it is < top_p (always keeps the top token)
        keep_sorted = (cum - sorted_p / sorted_p.sum(-1, keepdim=True)) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs (B, V), u (B,) uniforms in [0, 1) -> (B,) long token ids.

    Never returns a zero-probability token (right-sided search on the cumulative sum)."""
    cdf = probs.double().cumsum(-1)  # (B, V)
    x = (u.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def _cache_kwarg(model) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; accept both."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _out_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


@torch.no_grad()
def generate_tokens(
    model, prompt_ids: list[list[int]], max_new_tokens: int, pick: Callable[[torch.Tensor, int], torch.Tensor],
    eos_id: int | None, pad_id: int, fault: str | None = None,
) -> list[list[int]]:
    """The KV-cache generation loop (sampling and greedy decoding): left-padded prompts, next
    token = pick(logits (B, V), step) -> (B,) ids; each row stops after eos or max_new_tokens.
    Returns the generated ids per row (ending with eos if the row stopped)."""
    device = model_device(model)
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    am = torch.zeros((B, P), dtype=torch.long)
    for i, p in enumerate(prompt_ids):  # left padding
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        am[i, P - len(p):] = 1
    ids, am = ids.to(device), am.to(device)
    pos = (am.cumsum(1) - 1).clamp(min=0)  # (B, P)

    cache_kw = _cache_kwarg(model)
    cancel_point()  # a cancelled job stops between forward steps, not only between jobs' phases
    out = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True)
    if fault:
        fault_point(fault)  # tests only (compute.runtime.control)
    past = _out_cache(out)
    next_logits = out.logits[:, -1]  # (B, V)
    last_pos = pos[:, -1]  # (B,)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    generated = []
    for step in range(max_new_tokens):
        tok = pick(next_logits, step)  # (B,)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        generated.append(tok)
        if eos_id is not None:
            done = done | (tok == eos_id)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        cancel_point()
        am = torch.cat([am, torch.ones_like(am[:, :1])], dim=1)  # finished rows: ignored
        last_pos = last_pos + 1
        out = model(
            input_ids=tok.unsqueeze(1), attention_mask=am, position_ids=last_pos.unsqueeze(1),
            use_cache=True, **{cache_kw: past},
        )
        past = _out_cache(out)
        next_logits = out.logits[:, -1]
    gen = torch.stack(generated, dim=1).cpu()  # (B, steps)
    rows = []
    for i in range(B):
        row = []
        for t in gen[i].tolist():
            row.append(t)
            if eos_id is not None and t == eos_id:
                break
        rows.append(row)
    return rows


def _generate_batch(
    model, prompt_ids: list[list[int]], keys: list[tuple[int, int]], max_new_tokens: int,
    temperature: float, top_k: int | None, top_p: float | None, seed: int, eos_id: int | None,
    pad_id: int,
) -> list[list[int]]:
    """Sampled token ids per row: inverse-CDF draws from each row's own uniforms."""
    u = _row_uniforms(keys, seed, max_new_tokens).to(model_device(model))  # (B, steps)

    def pick(logits: torch.Tensor, step: int) -> torch.Tensor:
        return sample_from_probs(filter_probs(logits, temperature, top_k, top_p), u[:, step])

    return generate_tokens(model, prompt_ids, max_new_tokens, pick, eos_id, pad_id, fault="sampling")


def greedy_completions(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 8, batch_size: int = 256,
) -> list[str]:
    """Greedy completions (decoded, special tokens and eos dropped), batched, same loop as sampling."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: {max_new_tokens} must be >= 1")
    eos_id = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    prompt_ids = [_encode(tokenizer, p, special=True) for p in prompts]
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        for lo in range(0, len(prompt_ids), batch_size):
            rows = generate_tokens(model, prompt_ids[lo : lo + batch_size], max_new_tokens,
                                   lambda logits, _step: logits.argmax(-1), eos_id, pad)
            out += [tokenizer.decode([t for t in r if t != eos_id] if eos_id is not None else r,
                                     skip_special_tokens=True) for r in rows]
    finally:
        model.train(was_training)
    return out


def _pack(
    tokenizer, prompts: list[str], prompt_ids: list[list[int]], completion_ids: list[list[int]],
    prompt_index: list[int], device: torch.device | str | None,
) -> Rollout:
    """Right-padded Rollout from per-row prompt and completion token lists."""
    pad = _pad_id(tokenizer)
    rows = [prompt_ids[p] + c for p, c in zip(prompt_index, completion_ids, strict=True)]
    L = max((len(r) for r in rows), default=0)
    N = len(rows)
    ids = torch.full((N, L), pad, dtype=torch.long)
    am = torch.zeros((N, L), dtype=torch.long)
    cm = torch.zeros((N, L), dtype=torch.bool)
    for i, (r, p) in enumerate(zip(rows, prompt_index, strict=True)):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        am[i, : len(r)] = 1
        cm[i, len(prompt_ids[p]) : len(r)] = True
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completion_ids]
    roll = Rollout(ids, am, cm, torch.tensor(prompt_index, dtype=torch.long), list(prompts), texts)
    return roll.to(device) if device is not None else roll


def sample_completions(
    model, tokenizer, prompts: Sequence[str], samples: int, max_new_tokens: int,
    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
    seed: int = 0, batch_size: int | None = None, prompt_offset: int = 0,
) -> Rollout:
    """Sample `samples` completions per prompt from the model itself (on-policy).

    Rows are ordered prompt-major (row = prompt * samples + sample). Each row stops after eos or
    `max_new_tokens`; completion_mask covers the generated tokens including eos. Row randomness is
    seeded from (seed, prompt_offset + prompt index, sample index), so it does not depend on
    batch_size or on the other prompts. batch_size = rows per generation batch (None: all).
    Returns the Rollout on the model's device.
    """
    if samples < 1:
        raise ValueError(f"samples: got {samples}; must be >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: got {max_new_tokens}; must be >= 1")
    if temperature <= 0:
        raise ValueError(f"temperature: got {temperature}; must be > 0")
    prompts = list(prompts)
    prompt_ids = [_encode(tokenizer, p, special=True) for p in prompts]
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompts: every prompt must encode to at least one token")
    keys = [(p, s) for p in range(len(prompts)) for s in range(samples)]
    bs = batch_size or max(1, len(keys))
    eos_id = tokenizer.eos_token_id
    pad = _pad_id(tokenizer)
    was_training = model.training
    model.eval()
    completion_ids: list[list[int]] = []
    try:
        for start in range(0, len(keys), bs):
            chunk = keys[start : start + bs]
            completion_ids += _generate_batch(
                model, [prompt_ids[p] for p, _ in chunk],
                [(prompt_offset + p, s) for p, s in chunk], max_new_tokens, temperature,
                top_k, top_p, seed, eos_id, pad,
            )
    finally:
        model.train(was_training)
    roll = _pack(tokenizer, prompts, prompt_ids, completion_ids, [p for p, _ in keys],
                 model_device(model))
    # how long each row ran (the estimate of a later job prices its batches by these:
    # compute.contract.cost.length_record)
    roll.lengths = [(len(c), eos_id is not None and bool(c) and c[-1] == eos_id) for c in completion_ids]
    return roll


def build_rollout(
    tokenizer, prompts: Sequence[str], completions: Sequence[str],
    device: torch.device | str | None = None, add_eos: bool = True,
) -> Rollout:
    """A Rollout of given (gold) completions, one row per (prompt, completion) pair.

    The completion is tokenized without special tokens and followed by eos when add_eos."""
    prompts, completions = list(prompts), list(completions)
    if len(prompts) != len(completions):
        raise ValueError(
            f"completions: got {len(completions)} for {len(prompts)} prompts; need one per prompt"
        )
    prompt_ids = [_encode(tokenizer, p, special=True) for p in prompts]
    comp_ids = []
    for c in completions:
        ids = _encode(tokenizer, c, special=False)
        if add_eos and tokenizer.eos_token_id is not None:
            ids = ids + [int(tokenizer.eos_token_id)]
        comp_ids.append(ids)
    roll = _pack(tokenizer, prompts, prompt_ids, comp_ids, list(range(len(prompts))), device)
    roll.completions = list(completions)
    return roll


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, L) positions counting only real tokens (works for left and right padding)."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, chunk_size: int | None = None,
    return_logits: bool = False,
) -> Any:
    """(N, L) float32: log p(token t | tokens < t) under the model; 0 at t = 0 and on padding.

    The one token log-prob function (training, the bound, gradient masks). With return_logits:
    (log-probs, float32 logits (N, L-1, V) that predicted tokens 1..L-1). Differentiable (no
    no_grad here); wrap in torch.no_grad() when only values are needed.
    Without return_logits, a model whose head splits off exactly (compute.lm.head) never holds
    its whole logits: the real tokens' log-probs go through the head a chunk at a time."""
    from compute.lm.head import head_logprobs, hidden_states, split_head

    N = input_ids.shape[0]
    cs = chunk_size or N
    outs, all_logits = [], []
    for s in range(0, N, max(1, cs)):
        cancel_point()
        ids, am = input_ids[s : s + cs], attention_mask[s : s + cs]
        pos = position_ids_from_mask(am)
        parts = None if return_logits else split_head(model, ids, am, pos)
        if parts is not None:
            h = hidden_states(parts[0], ids, am, pos)  # (n, L, H)
            real = am[:, 1:].reshape(-1).nonzero().squeeze(-1)  # positions 1..L-1 holding a token
            lp = head_logprobs(parts[1], h[:, :-1].reshape(-1, h.shape[-1]).index_select(0, real),
                               ids[:, 1:].reshape(-1).index_select(0, real))
            tok = torch.zeros(ids.shape[0] * (ids.shape[1] - 1), dtype=lp.dtype, device=lp.device)
            tok = tok.index_put((real,), lp).view(ids.shape[0], ids.shape[1] - 1)
            outs.append(torch.cat([torch.zeros_like(tok[:, :1]), tok], dim=1))
            continue
        logits = model(
            input_ids=ids, attention_mask=am, position_ids=pos
        ).logits[:, :-1].float()  # (n, L-1, V)
        tok = logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (n, L-1)
        tok = torch.cat([torch.zeros_like(tok[:, :1]), tok], dim=1)  # (n, L)
        outs.append(tok * am.to(tok.dtype))
        if return_logits:
            all_logits.append(logits)
    lp = torch.cat(outs, dim=0)
    return (lp, torch.cat(all_logits, dim=0)) if return_logits else lp
