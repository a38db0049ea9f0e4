"""A tied embedding + output head without a per-row buffer (compute/fisher/accumulate.py, issue 30):
a row's gradient of the shared matrix is the head's H_n plus the lookup's E_n; every vocabulary
row its tokens do not touch takes H_n^2 from the head's square sum, the touched rows (H_n + E_n)^2
whole. The result must equal float64 per-sample autograd, with repeated tokens in a row, left
padding, several groups (split halves) and both estimators, and no (B, vocab, hidden) buffer."""

from __future__ import annotations

import pytest
import torch

from compute.fisher import fisher_from_samples, fisher_sums
from compute.fisher.accumulate import Accumulator
from tests.unit.fisher_tiny import family_model
from tests.unit.test_arch_matrix import _rows, reference, worst_error


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
@pytest.mark.parametrize("estimator", ["sequence", "token"])
def test_tied_head_equals_per_sample_autograd_without_a_row_buffer(family, estimator, monkeypatch):
    def no_buffer(self, name):
        raise AssertionError(f"a per-row buffer for {name}")

    monkeypatch.setattr(Accumulator, "row_buffer", no_buffer)
    model = family_model(family, tied=True, seed=7)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids, am, cm = _rows(left=True, seed=3)
    ids[:, -3:] = ids[:, -4:-3]  # a token repeated within each row (one vocabulary row, several uses)
    got = fisher_from_samples(model, ids, am, cm, estimator=estimator, batch_size=2)
    err, where = worst_error(got, reference(model, ids, am, cm)[estimator])
    assert err <= 1e-5, f"{family} {estimator}: {err:.3g} at {where}"


def test_tied_head_groups_are_the_halves_of_the_rows():
    """Two groups (the split halves): each group's sum is the Fisher sum of its own rows."""
    model = family_model("llama", tied=True, seed=8)
    ids, am, cm = _rows(left=False, seed=4)
    groups = torch.arange(ids.shape[0]) % 2
    sums, _ = fisher_sums(model, ids, am, cm, groups=groups, n_groups=2, batch_size=3)
    name = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    for k in (0, 1):
        sel = groups == k
        ref = reference(model, ids[sel], am[sel], cm[sel])["sequence"][name]  # float64 mean of its rows
        got = sums[name][k].double() / int(sel.sum())
        err = float((got - ref).abs().sum() / ref.abs().sum())
        # float32 sums of squares of these larger-than-usual weights: ~1.5e-5 before and after the
        # tied path (every other parameter is at the same level)
        assert err <= 3e-5, f"group {k}: {err:.3g}"
