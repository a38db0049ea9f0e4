"""The brute-force reference the sequence Fisher engine is held against on real models: one
backward per row, float32, through autograd's parameter .grad (no hooks, no per-sample maths).

    check = compare_sequence_fisher(model, tokenizer, ["The capital of France is Paris.", "2+2=4"])
    check.total_rel, check.worst_tensor, check.passes(allow_unreached=False)

Used by the real-model tests (tests/unit/fisher_tiny.py asserts on it) and by
benchmarks/real_models.py (records the numbers in a committed file). Thresholds: the engine's
Fisher must match the reference to a relative L1 error of TOTAL_RTOL over all tensors together
and TENSOR_RTOL for every tensor on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# relative L1 error allowed over all tensors together / for each tensor on its own
TOTAL_RTOL = 1e-4
TENSOR_RTOL = 1e-3


def pack_right_padded(tokenizer: Any, texts: list[str], prompt_tokens: int = 2
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, completion_mask), (N, L) right-padded; the first
    `prompt_tokens` tokens of each row are the prompt (not counted)."""
    if not texts:
        raise ValueError("texts: need at least one text")
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens: got {prompt_tokens}; must be >= 0")
    enc = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), tokenizer.pad_token_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
        am[i, : len(e)] = 1
    cm = am.clone()
    cm[:, :prompt_tokens] = 0
    return ids, am, cm


def per_row_sequence_fisher(model: nn.Module, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor, completion_mask: torch.Tensor
                            ) -> dict[str, torch.Tensor]:
    """Mean over rows of the squared gradient of each row's summed completion log-probability,
    one forward + backward per row (each row cut to its real tokens; right padding), squared in
    float32. Leaves the model's .grad cleared."""
    ref: dict[str, torch.Tensor] = {}
    n_rows = input_ids.shape[0]
    for i in range(n_rows):
        n = int(attention_mask[i].sum())
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=input_ids[i : i + 1, :n]).logits[0, :-1].float()  # (n-1, V)
        lp = logits.log_softmax(-1).gather(-1, input_ids[i, 1:n, None]).squeeze(-1)  # (n-1,)
        (lp * completion_mask[i, 1:n].float()).sum().backward()
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            g2 = p.grad.float().square()
            ref[name] = ref[name] + g2 if name in ref else g2
    model.zero_grad(set_to_none=True)
    return {k: v / n_rows for k, v in ref.items()}


@dataclass
class SequenceFisherCheck:
    """The engine's sequence Fisher (`got`) against the per-row reference (`ref`)."""

    got: dict[str, torch.Tensor]
    ref: dict[str, torch.Tensor]
    n_rows: int
    n_tokens: int

    @property
    def names_match(self) -> bool:
        return set(self.got) == set(self.ref)

    @property
    def total_rel(self) -> float:
        """sum |got - ref| / sum |ref| over every tensor (inf when the reference is all zero)."""
        err = sum(float((self.got[k] - self.ref[k]).abs().sum()) for k in self.ref)
        total = sum(float(self.ref[k].abs().sum()) for k in self.ref)
        return err / total if total > 0 else float("inf")

    def tensor_rel(self) -> dict[str, float | None]:
        """name -> |got - ref|_1 / |ref|_1; None for a tensor no row reaches (zero reference)."""
        out: dict[str, float | None] = {}
        for k in self.ref:
            denom = float(self.ref[k].abs().sum())
            out[k] = float((self.got[k] - self.ref[k]).abs().sum()) / denom if denom > 0 else None
        return out

    def unreached(self) -> dict[str, float]:
        """Tensors with a zero reference -> the engine's |got|_1 there (0 when it agrees)."""
        return {k: float(self.got[k].abs().sum()) for k in self.ref
                if float(self.ref[k].abs().sum()) == 0}

    @property
    def worst_tensor(self) -> tuple[str, float] | None:
        rels = {k: v for k, v in self.tensor_rel().items() if v is not None}
        if not rels:
            return None
        name = max(rels, key=lambda k: rels[k])
        return name, rels[name]

    def failures(self, allow_unreached: bool = False) -> list[str]:
        """Why the engine fails the thresholds (empty list: it passes). A tensor no row reaches
        fails unless `allow_unreached`, and then only if the engine gives it a non-zero value."""
        why: list[str] = []
        if not self.names_match:
            why.append(f"tensor names differ: engine only {sorted(set(self.got) - set(self.ref))}, "
                       f"reference only {sorted(set(self.ref) - set(self.got))}")
            return why
        if not self.total_rel <= TOTAL_RTOL:
            why.append(f"total relative L1 {self.total_rel:.3g} > {TOTAL_RTOL:g}")
        for k, rel in self.tensor_rel().items():
            if rel is None:
                got = float(self.got[k].abs().sum())
                if not allow_unreached:
                    why.append(f"{k}: no row reaches it (zero reference)")
                elif got != 0:
                    why.append(f"{k}: zero reference but engine gives {got:.3g}")
            elif not rel <= TENSOR_RTOL:
                why.append(f"{k}: relative L1 {rel:.3g} > {TENSOR_RTOL:g}")
        return why

    def passes(self, allow_unreached: bool = False) -> bool:
        return not self.failures(allow_unreached)


def compare_sequence_fisher(model: nn.Module, tokenizer: Any, texts: list[str],
                            prompt_tokens: int = 2, batch_size: int = 1) -> SequenceFisherCheck:
    """Pack `texts` right-padded, run the engine's sequence Fisher (with `batch_size` rows per
    chunk; 1 < N rows exercises chunking) and the one-backward-per-row reference on the same rows."""
    from compute.fisher.estimators import fisher_from_samples

    ids, am, cm = pack_right_padded(tokenizer, texts, prompt_tokens)
    got = fisher_from_samples(model, ids, am, cm, estimator="sequence", batch_size=batch_size)
    ref = per_row_sequence_fisher(model, ids, am, cm)
    return SequenceFisherCheck(got, ref, len(texts), int(cm.sum()))
