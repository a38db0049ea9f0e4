"""The float32 check of a half-precision Fisher (compute.fisher.precision, issue 30): the job's own
model made float32 in place, not a second copy, gives the same numbers as a float32 copy would,
leaves every parameter and buffer bit for bit as it was, reads a wider checkpoint's own values,
and is planned within the job's memory allowance (compute.jobs.fisher_run.precision_check_plan)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from compute.fisher import fisher_from_samples, relative_error
from compute.fisher import statistics as analysis
from compute.fisher.precision import check_bytes, float32_weights, precision_error
from tests.unit.fisher_tiny import VOCAB, tiny_model


def _roll(seed: int = 0, n: int = 6, L: int = 10) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, L), generator=g)
    lens = torch.randint(L // 2, L + 1, (n,), generator=g)
    am = (torch.arange(L)[None] < lens[:, None]).long()
    return SimpleNamespace(input_ids=ids, attention_mask=am, completion_mask=am.bool() & (torch.arange(L)[None] >= 3))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("estimator", ["sequence", "token"])
def test_in_place_reference_equals_a_float32_copy_and_restores_bit_for_bit(tied, estimator):
    model = tiny_model("qwen3", hidden=32, tied=tied, seed=2, dtype=torch.bfloat16)
    before = _state(model)
    roll = _roll()
    got = precision_error(model, roll, estimator, memory_budget_mb=64, rows=4)
    # brute force: the old reference, a float32 copy of the model beside it, same rows and batch
    ids, am, cm = (t[:4] for t in (roll.input_ids, roll.attention_mask, roll.completion_mask))
    low = fisher_from_samples(model, ids, am, cm, estimator, batch_size=got["rows_per_forward"])
    ref = fisher_from_samples(copy.deepcopy(model).float(), ids, am, cm, estimator,
                              batch_size=got["rows_per_forward"])
    num = sum(float((low[k].double() - ref[k].double()).abs().sum()) for k in ref)
    den = sum(float(ref[k].double().abs().sum()) for k in ref)
    assert got["relative_l1"] == pytest.approx(num / den, rel=1e-9) and got["relative_l1"] > 0
    per = {k: relative_error(low[k], ref[k]) for k in ref}
    assert got["worst_tensor"] == max(per, key=lambda k: per[k])
    assert got["topk_jaccard"] == analysis.topk_jaccard(low, ref, 1.0)
    assert got["reference"].startswith("the loaded weights computed in float32")
    after = _state(model)
    assert all(after[n].dtype == before[n].dtype and torch.equal(after[n], before[n]) for n in before)
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_float32_checkpoint_values_are_the_reference(tmp_path):
    """A float32 checkpoint loaded in bf16: the reference is the file's float32 values (the
    weights' rounding counts, as loading the checkpoint in float32 would), and the restore is
    exact because a tensor is read only when its values cast to bf16 are the loaded ones."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama", hidden=32, tied=True, seed=3).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    full = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    before = _state(model)
    with float32_weights(model) as counts:
        widened = dict(model.named_parameters())
        for n, p in full.named_parameters():
            assert widened[n].dtype == torch.float32 and torch.equal(widened[n], p), n
    assert counts["from_checkpoint"] == len(dict(model.named_parameters())) and counts["upcast"] == 0
    after = _state(model)
    assert all(torch.equal(after[n], before[n]) for n in before)
    roll = _roll(1)
    got = precision_error(model, roll, "sequence", 64, rows=4)
    assert got["reference"].startswith("the checkpoint's float32 values")
    ids, am, cm = (t[:4] for t in (roll.input_ids, roll.attention_mask, roll.completion_mask))
    low = fisher_from_samples(model, ids, am, cm, batch_size=got["rows_per_forward"])
    ref = fisher_from_samples(full, ids, am, cm, batch_size=got["rows_per_forward"])
    num = sum(float((low[k] - ref[k]).double().abs().sum()) for k in ref)
    den = sum(float(ref[k].double().abs().sum()) for k in ref)
    assert got["relative_l1"] == pytest.approx(num / den, rel=1e-6)


def test_the_check_is_planned_within_the_allowance(monkeypatch):
    """On a CPU the Fisher's own sums (6 bytes/param) are held when the check runs: its widened
    weights and two sums (10 bytes/param for bf16) come out of the temporaries budget, and it is
    skipped, saying why, when fewer than PRECISION_CHECK_MIN_TEMPORARIES_MB are left."""
    from compute.contract.cost import PRECISION_CHECK_MIN_TEMPORARIES_MB
    from compute.jobs.fisher_run import precision_check_plan

    model = tiny_model("qwen3", hidden=64, tied=True, seed=1, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert check_bytes(model) == 10 * n
    held = 6 * n
    need_mb = 10 * n / 2**20
    budget = int(need_mb + PRECISION_CHECK_MIN_TEMPORARIES_MB + 8)
    skip, temps = precision_check_plan(model, held, budget)
    assert skip is None and temps == int((budget * 2**20 - 10 * n) // 2**20)
    skip, temps = precision_check_plan(model, held, int(need_mb + PRECISION_CHECK_MIN_TEMPORARIES_MB - 8))
    assert temps == 0 and skip.startswith("not measured: scoring the first rows again in float32 needs")
    assert "--memory-budget-mb" in skip
