"""Token-pass formulas the kinds' cost estimates share (compute/jobs/<kind>.py `cost`).

Unit: a token-pass is one token through one forward pass; a backward pass counts as two forward
passes (a gradient step over a sequence of L tokens is 3 L token-passes). app/limits.py
multiplies a kind's token-passes by the parameters of the largest model the spec names. Prompts
are counted as `COST_PROMPT_TOKENS` tokens (the arithmetic tasks use fewer, GSM8K-style jsonl
prompts about that many) and every completion as `max_new_tokens` (sampling may stop early), so
an estimate is an upper bound for that prompt length.

Pure: no imports beyond the standard library (the web process estimates with it).
"""

from __future__ import annotations

COST_PROMPT_TOKENS = 64


def fisher_passes(prompts: int, samples: int, max_new_tokens: int, estimator: str = "sequence",
                  exact_output: bool = False) -> int:
    """A Fisher estimate: sampling (KV cache), one backward per sequence (per completion token
    for the `token` estimator: its naive cost; the batched engine is faster), and one more
    forward per sequence for the exact output-layer check."""
    seqs = prompts * samples
    length = COST_PROMPT_TOKENS + max_new_tokens
    sample = 0 if estimator == "empirical" else seqs * length  # generation (KV cache)
    grads = seqs * length * 3 * (max_new_tokens if estimator == "token" else 1)
    exact = seqs * length if exact_output else 0
    return sample + grads + exact


def train_passes(algo: str, steps: int, batch: int, group: int, max_new_tokens: int,
                 eval_prompts: int) -> int:
    """One training run: per step a gradient over every sequence, sampling (not for SFT) and a
    teacher forward (OPD); greedy held-out accuracy before and after."""
    length = COST_PROMPT_TOKENS + max_new_tokens
    seqs = batch * (1 if algo == "sft" else group)
    per_seq = 3 + (0 if algo == "sft" else 1) + (1 if algo == "opd" else 0)  # grad, sample, teacher
    evals = 2 * eval_prompts * length  # greedy accuracy before and after
    return steps * seqs * length * per_seq + evals
