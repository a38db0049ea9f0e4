"""The per-algorithm objectives of the training loop (compute.train.objectives) against values
computed here from one plain forward pass per row (no batching, no padding, float64)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from compute.lm.verifiable_tasks import get_task
from compute.train import TrainConfig
from compute.train.objectives import make_objective
from tests.unit.fisher_tiny import char_tokenizer, tiny_model


@torch.no_grad()
def _row_logprobs(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token t | < t) for t = 1..len-1 and the logits that predicted them, one row alone."""
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, :-1].double()  # (len-1, V)
    return logits.log_softmax(-1).gather(-1, x[0, 1:, None]).squeeze(-1), logits


def _rows(batch):
    for i in range(len(batch)):
        n = int(batch.attention_mask[i].sum())
        yield batch.input_ids[i, :n].tolist(), batch.completion_mask[i, : n - 1]


def test_sft_gold_loss_is_the_token_mean_nll_of_answers_and_eos() -> None:
    tok, task, model = char_tokenizer(), get_task("arithmetic-add?digits=1"), tiny_model("qwen3")
    obj = make_objective(TrainConfig(algo="sft", batch=3, seed=2), model, tok, task)
    batch = obj.make_batch(model, step=1)
    answers = [e.answer for e in task.examples(3, seed=2, split="train", start=3)]
    nll, count = 0.0, 0
    for (ids, cm), answer in zip(_rows(batch), answers, strict=True):
        assert int(cm.sum()) == len(answer) + 1  # the answer's characters and eos
        lp, _ = _row_logprobs(model, ids)
        nll -= float(lp[cm].sum())
        count += int(cm.sum())
    loss, _ = obj.loss(model, batch)
    assert_close(float(loss.detach()), nll / count, rtol=1e-5, atol=1e-6)


def test_grpo_loss_with_one_update_is_minus_the_advantage_weighted_token_mean() -> None:
    # one update per batch: ratio 1, so loss = -sum_n A_n T_n / sum_n T_n, gradient A grad log p
    class ParityTask:  # a reward a random model earns about half the time: non-zero advantages
        base = get_task("arithmetic-add?digits=1")

        def examples(self, *a, **k):
            return self.base.examples(*a, **k)

        def reward(self, completion, answer):
            return float(len(completion) % 2)

    tok, task, model = char_tokenizer(), ParityTask(), tiny_model("qwen3")
    obj = make_objective(TrainConfig(algo="grpo", batch=2, group=4, max_new_tokens=4), model, tok, task)
    batch = obj.make_batch(model, step=0)
    adv, cm = batch.extra["advantages"], batch.completion_mask
    assert float(adv.abs().sum()) > 0 and 0 < batch.metrics["reward"] < 1
    t = cm.sum(1).double()
    loss, stats = obj.loss(model, batch)
    assert_close(float(loss.detach()), float(-(adv.double() * t).sum() / t.sum()), rtol=1e-6, atol=1e-7)
    assert stats["ratio"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0
    assert batch.extra["old_lp"] is None and batch.extra["ref_lp"] is None


def test_opd_full_loss_is_the_exact_reverse_kl_per_completion_token() -> None:
    tok, task = char_tokenizer(), get_task("arithmetic-add?digits=1")
    student, teacher = tiny_model("qwen3"), tiny_model("qwen3", seed=1)
    cfg = TrainConfig(algo="opd", batch=2, group=2, max_new_tokens=3)
    obj = make_objective(cfg, student, tok, task, teacher=teacher, teacher_tokenizer=tok)
    batch = obj.make_batch(student, step=0)
    total, count = 0.0, 0
    for ids, cm in _rows(batch):
        _, ls = _row_logprobs(student, ids)
        _, lt = _row_logprobs(teacher, ids)
        ps, lps, lpt = ls.softmax(-1), ls.log_softmax(-1), lt.log_softmax(-1)
        kl = (ps * (lps - lpt)).sum(-1)  # (len-1,) exact KL(student || teacher) per position
        total += float(kl[cm].sum())
        count += int(cm.sum())
    loss, stats = obj.loss(student, batch)
    assert_close(float(loss.detach()), total / count, rtol=1e-5, atol=1e-6)
    assert stats["reverse_kl_full"] == pytest.approx(total / count, rel=1e-5)
    with pytest.raises(ValueError, match="^teacher:"):
        make_objective(cfg, student, tok, task)


def test_every_algorithm_of_the_spec_has_one_objective() -> None:
    from compute.train import ALGOS
    from compute.train.objectives import OBJECTIVES

    assert set(OBJECTIVES) == set(ALGOS) == {"grpo", "opd", "sft"}
