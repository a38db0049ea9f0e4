"""compute.runtime.control.cancel_point: a cancel takes effect inside sampling (between generation steps
and forward chunks), not only between a job's phases; outside a cancel scope it does nothing."""

from __future__ import annotations

import pytest
import torch

from compute.contract.jobresult import JobCancelled
from compute.lm.sampling import sample_completions, token_logprobs
from compute.runtime.control import cancel_scope
from tests.unit.fisher_tiny import char_tokenizer, tiny_model


class Counter:
    """A cancel check that raises on its n-th call (n=None: never)."""

    def __init__(self, stop_at: int | None):
        self.calls = 0
        self.stop_at = stop_at

    def __call__(self, force: bool) -> None:
        self.calls += 1
        if self.stop_at is not None and self.calls >= self.stop_at:
            raise JobCancelled("cancelled")


def test_sampling_checks_cancel_at_every_step_and_stops_mid_generation() -> None:
    tok, model = char_tokenizer(), tiny_model()
    prompts = ["12+3=", "4+5="]
    free = Counter(None)
    with cancel_scope(free):
        full = sample_completions(model, tok, prompts, samples=2, max_new_tokens=6, seed=1)
    # one check before the prompt forward and one before each later step, per batch
    assert free.calls >= 2
    stop = Counter(2)  # cancel requested after the first generation step
    with cancel_scope(stop), pytest.raises(JobCancelled):
        sample_completions(model, tok, prompts, samples=2, max_new_tokens=6, seed=1)
    assert stop.calls == 2
    # outside a scope nothing is checked and the samples are the same
    again = sample_completions(model, tok, prompts, samples=2, max_new_tokens=6, seed=1)
    assert torch.equal(again.input_ids, full.input_ids)


def test_forward_chunks_check_cancel() -> None:
    tok, model = char_tokenizer(), tiny_model()
    roll = sample_completions(model, tok, ["1+1=", "2+2=", "3+3="], samples=2, max_new_tokens=3)
    seen = Counter(None)
    with cancel_scope(seen), torch.no_grad():
        token_logprobs(model, roll.input_ids, roll.attention_mask, chunk_size=2)
    assert seen.calls == 3  # 6 rows in chunks of 2
    with cancel_scope(Counter(2)), torch.no_grad(), pytest.raises(JobCancelled):
        token_logprobs(model, roll.input_ids, roll.attention_mask, chunk_size=2)


def test_mask_selection_checks_cancel_per_tensor() -> None:
    """topk_mask (every selector's last step) checks cancel before each tensor of each pass, so
    a selection over many tensors (a large Fisher) stops within one tensor of a cancel."""
    from compute.sparsity.masks import topk_mask

    scores = {f"t{i}": torch.rand(5) for i in range(40)}
    free = Counter(None)
    with cancel_scope(free):
        mask = topk_mask(scores, 17)
    assert sum(int(m.sum()) for m in mask.values()) == 17
    assert free.calls == 3 * 40  # three passes, one check per tensor each
    stop = Counter(10)  # cancelled while the first pass is on its 10th tensor
    with cancel_scope(stop), pytest.raises(JobCancelled):
        topk_mask(scores, 17)
    assert stop.calls == 10
