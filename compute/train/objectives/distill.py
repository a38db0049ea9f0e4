"""On-policy distillation (OPD): the student samples, the teacher scores the same tokens, and the
loss is the per-token reverse KL(student || teacher) on the student's own sampled tokens. The
maths and the objective.

Two estimators (the result records which):
- ``full``: the exact per-position reverse KL over the whole vocabulary,
      KL_t = sum_v p_s(v | y_<t) (log p_s(v | y_<t) - log p_t(v | y_<t)),
  differentiated through the student's probabilities directly.
- ``sampled``: the sampled-token estimate used with policy-gradient form (Thinking Machines'
  on-policy distillation): a_t = log p_s(y_t) - log p_t(y_t) (detached) is a per-token cost, loss
  = mean_t a_t * log p_s(y_t). Its gradient a_t * grad log p_s(y_t) has the form of docs/science.md
  section 3 with A = log p/q. Per-token, no credit from future tokens (discount 0).
Teacher and student must share the tokenizer: the same token ids mean the same strings.
"""

from __future__ import annotations

from typing import Any

import torch

from compute.train.objectives.base import Batch, aggregate, frozen, policy_logprobs, sampled_rollout

DISTILL_ESTIMATORS = ("full", "sampled")


def reverse_kl_full(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Exact per-position KL(student || teacher).

    student_logits, teacher_logits: (N, T, V) (same V). Returns (N, T) float32, grad through student.
    """
    ls = torch.log_softmax(student_logits.float(), dim=-1)  # (N, T, V)
    lt = torch.log_softmax(teacher_logits.detach().float(), dim=-1)
    return (ls.exp() * (ls - lt)).sum(dim=-1)


def sampled_token_cost(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per-token reverse-KL estimate on the sampled tokens: log p_s(y_t) - log p_t(y_t). (N, T)."""
    return student_logp - teacher_logp


def distill_loss(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "full",
    student_logits: torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None,
    aggregation: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """OPD loss to minimise.

    student_logp, teacher_logp: (N, T) log-probs of the student's sampled tokens (student with grad);
    mask: (N, T) bool completion tokens; for 'full', student_logits/teacher_logits (N, T, V) aligned
    with those positions (logits predicting token t at index t).
    Returns (loss, stats): stats["reverse_kl"] is the mean per-token sampled estimate (both cases).
    """
    cost = sampled_token_cost(student_logp.detach(), teacher_logp.detach())  # (N, T)
    if estimator == "full":
        if student_logits is None or teacher_logits is None:
            raise ValueError("estimator: 'full' needs student_logits and teacher_logits")
        per_token = reverse_kl_full(student_logits, teacher_logits)
    elif estimator == "sampled":
        per_token = cost * student_logp
    else:
        raise ValueError(f"estimator: got {estimator!r}; accepted: {', '.join(DISTILL_ESTIMATORS)}")
    loss = aggregate(per_token, mask, aggregation)
    stats = {"reverse_kl": float(aggregate(cost, mask, "token"))}
    if estimator == "full":
        stats["reverse_kl_full"] = float(aggregate(per_token.detach(), mask, "token"))
    return loss, stats


def check_same_tokenizer(student_tokenizer: Any, teacher_tokenizer: Any) -> None:
    """Raise ValueError('teacher: ...') unless both tokenizers map the same strings to the same ids."""
    vs, vt = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if vs == vt:
        return
    only_s = sorted(set(vs) - set(vt))[:3]
    only_t = sorted(set(vt) - set(vs))[:3]
    moved = sorted(k for k in set(vs) & set(vt) if vs[k] != vt[k])[:3]
    raise ValueError(
        f"teacher: tokenizer differs from the student's (vocab {len(vs)} vs {len(vt)}; "
        f"only in student: {only_s}, only in teacher: {only_t}, different ids: {moved}); "
        "on-policy distillation needs a teacher with the same tokenizer"
    )


class Distill:
    updates = 1

    def __init__(self, config: Any, model: torch.nn.Module, tokenizer: Any, task: Any,
                 teacher: torch.nn.Module | None = None, teacher_tokenizer: Any = None, **_: Any):
        if teacher is None:
            raise ValueError("teacher: on-policy distillation (algo 'opd') needs a teacher model")
        if teacher_tokenizer is not None:
            check_same_tokenizer(tokenizer, teacher_tokenizer)
        self.config, self.tokenizer, self.task = config, tokenizer, task
        self.teacher = frozen(teacher)
        self.full = config.distill_estimator == "full"

    def make_batch(self, model: torch.nn.Module, step: int) -> Batch:
        roll, rewards = sampled_rollout(model, self.tokenizer, self.task, self.config, step)
        batch = Batch.of(roll, {"reward": float(rewards.mean())})
        with torch.no_grad():
            batch.extra["t_lp"], batch.extra["t_logits"] = policy_logprobs(self.teacher, batch, self.full)
        return batch

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        lp, logits = policy_logprobs(model, batch, self.full)
        t_logits = batch.extra["t_logits"]
        if logits is not None and t_logits is not None and logits.shape[-1] != t_logits.shape[-1]:
            v = min(logits.shape[-1], t_logits.shape[-1])  # padded vocab rows carry no tokens
            logits, t_logits = logits[..., :v], t_logits[..., :v]
        return distill_loss(lp, batch.extra["t_lp"], batch.completion_mask, self.config.distill_estimator,
                            logits, t_logits, self.config.aggregation)
