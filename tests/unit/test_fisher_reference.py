"""compute.fisher.reference, the brute force the real-model tests and benchmarks/real_models.py
hold the engine against: on tiny models it agrees with the engine, and its verdict catches a
wrong tensor, a missing tensor and a tensor no row reaches."""

from __future__ import annotations

import pytest
import torch

from compute.fisher.reference import (
    TENSOR_RTOL,
    TOTAL_RTOL,
    compare_sequence_fisher,
    pack_right_padded,
    per_row_sequence_fisher,
)
from tests.unit.fisher_tiny import char_tokenizer, tiny_model

TEXTS = ["12+34=46", "3*4=12", "7+8=15"]


@pytest.mark.parametrize("arch,tied", [("llama", True), ("gpt2", False)])
def test_engine_matches_reference_on_tiny_models(arch: str, tied: bool) -> None:
    c = compare_sequence_fisher(tiny_model(arch, tied=tied), char_tokenizer(), TEXTS)
    assert c.names_match and c.n_rows == 3
    assert c.n_tokens == sum(len(t) - 2 for t in TEXTS)
    assert c.total_rel <= TOTAL_RTOL and c.passes(), c.failures()
    worst = c.worst_tensor
    assert worst is not None and worst[1] <= TENSOR_RTOL and worst[0] in c.ref


def test_reference_is_the_mean_of_per_row_squared_gradients() -> None:
    model, tok = tiny_model("qwen3"), char_tokenizer()
    ids, am, cm = pack_right_padded(tok, TEXTS[:2], prompt_tokens=3)
    assert am[1].tolist() == [1] * 6 + [0] * 2 and cm[1].tolist() == [0] * 3 + [1] * 3 + [0] * 2
    ref = per_row_sequence_fisher(model, ids, am, cm)
    # by hand: row 0's squared gradient alone, then the mean with row 1
    row0 = per_row_sequence_fisher(model, ids[:1], am[:1], cm[:1])
    row1 = per_row_sequence_fisher(model, ids[1:], am[1:], cm[1:])
    for k in ref:
        torch.testing.assert_close(ref[k], (row0[k] + row1[k]) / 2)
    assert all(p.grad is None for p in model.parameters())


def test_verdict_catches_a_wrong_a_missing_and_an_unreached_tensor() -> None:
    c = compare_sequence_fisher(tiny_model("llama"), char_tokenizer(), TEXTS)
    name = next(iter(c.got))
    c.got[name] = c.got[name] * 1.01  # 1% off in one tensor: fails that tensor
    assert any(f.startswith(f"{name}: relative L1") for f in c.failures())
    c.got[name] = c.got[name] / 1.01
    del c.got[name]
    assert not c.names_match and "tensor names differ" in c.failures()[0]
    c.got[name] = c.ref[name].clone()
    c.ref[name] = torch.zeros_like(c.ref[name])  # a tensor no row reaches
    c.got[name] = torch.zeros_like(c.got[name])
    assert c.failures() == [f"{name}: no row reaches it (zero reference)"]
    assert c.passes(allow_unreached=True) and c.unreached() == {name: 0.0}
    c.got[name] = c.got[name] + 1
    assert not c.passes(allow_unreached=True)
