"""Issue 30: the split halves of a Fisher job held in 6 bytes/param (an exact float32 total and an
int16 fraction of it for the half difference), the engine's self-check in groups that fit the
temporaries budget, and the large-weight and shared-weight squares streamed into the sums. Every
result is checked against the exact (float64, two full halves) computation of the same rows."""

from __future__ import annotations

import copy

import pytest
import torch

from compute.fisher import UnsupportedModel, estimators, fisher_from_samples, fisher_sums
from compute.fisher import accumulate as acc_mod
from compute.fisher.accumulate import FRAC_SCALE, HalfSums, Store
from compute.fisher.estimators import (
    check_groups,
    new_store,
    per_sample_square_sums,
    trainable_parameters,
)
from compute.fisher.statistics import topk_jaccard
from compute.lm.sampling import sample_completions
from tests.unit.fisher_tiny import char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _roll(model, tok, seed=3):
    return sample_completions(model, tok, ["1+2=", "123*45=", "7=", "88-9="], 3, 5, seed=seed)


def _compact_and_exact(model, roll, estimator, batch_size=None):
    """(HalfSums of the float32 model, compact store), (A, B) exact: the same rows through a
    float64 copy of the model (two full halves in float64)."""
    N = roll.input_ids.shape[0]
    groups = torch.arange(N) % 2
    store = new_store(model, 2)
    assert store.compact
    fisher_sums(model, roll.input_ids, roll.attention_mask, roll.completion_mask, estimator,
                groups=groups, n_groups=2, batch_size=batch_size, into=store)
    halves = store.finish_halves()
    m64 = copy.deepcopy(model).double()
    exact, _ = fisher_sums(m64, roll.input_ids, roll.attention_mask, roll.completion_mask, estimator,
                           groups=groups, n_groups=2, batch_size=batch_size)
    return halves, exact


@pytest.mark.parametrize("arch,tied,estimator", [("llama", True, "sequence"), ("qwen3", False, "token"),
                                                 ("gpt2", True, "token")])
def test_compact_halves_match_exact_halves_within_the_stated_bound(tok, arch, tied, estimator):
    model = tiny_model(arch, tied=tied, seed=5)
    roll = _roll(model, tok)
    halves, exact = _compact_and_exact(model, roll, estimator, batch_size=3)
    assert halves.compact and halves.roundings >= 2  # several passes re-encoded the difference
    bound = halves.half_error_bound()
    assert 0 < bound < 1e-3
    for n, ex in exact.items():
        t = halves.total[n].double()
        # the total is the Fisher's float32 sum: float32 rounding only
        torch.testing.assert_close(t, ex[0] + ex[1], rtol=1e-4, atol=1e-6 * float(t.max()))
        for k in (0, 1):
            got = halves.half(n, k).double()
            err = (got - ex[k]).abs()
            # the stated bound (relative to the coordinate's total) plus float32 rounding
            assert bool((err <= bound * t + 1e-4 * t + 1e-6 * float(t.max())).all()), n
    # the split-half Jaccard from the compact halves is the exact one
    a = {n: ex[0] for n, ex in exact.items()}
    b = {n: ex[1] for n, ex in exact.items()}
    for pct in (1.0, 10.0):
        assert topk_jaccard(halves.view(0), halves.view(1), pct) == pytest.approx(topk_jaccard(a, b, pct))


def test_streamed_blocks_and_slices_give_the_same_sums(tok, monkeypatch):
    """Large weights squared a block of rows at a time, shared weights' per-row gradients squared a
    slice at a time: tiny blocks and slices must give what one whole-tensor update gives."""
    model = tiny_model("llama", tied=True, seed=8)
    roll = _roll(model, tok, seed=4)
    whole, _ = _compact_and_exact(model, roll, "sequence", batch_size=4)
    monkeypatch.setattr(acc_mod, "BLOCK_VALUES", 40)
    monkeypatch.setattr(acc_mod, "UPDATE_CHUNK", 64)
    small, _ = _compact_and_exact(model, roll, "sequence", batch_size=4)
    for n, t in whole.total.items():
        torch.testing.assert_close(small.total[n], t, rtol=1e-5, atol=1e-7 * float(t.max()))
        torch.testing.assert_close(small.half(n, 0), whole.half(n, 0), rtol=1e-3,
                                   atol=2 * whole.half_error_bound() * float(t.max()) + 1e-7)


def test_merged_shards_add_totals_and_differences():
    torch.manual_seed(0)
    parts, ea, eb = [], torch.zeros(50), torch.zeros(50)
    for _ in range(3):
        a, b = torch.rand(50), torch.rand(50)
        ea, eb = ea + a, eb + b
        parts.append(HalfSums({"w": a + b}, {"w": HalfSums.encode(a + b, a - b)}, 1))
    m = HalfSums.merged(parts)
    assert m.roundings == 4
    torch.testing.assert_close(m.total["w"], ea + eb)
    tol = m.half_error_bound() * (ea + eb) + 1e-6
    assert bool(((m.half("w", 0) - ea).abs() <= tol).all())
    assert bool(((m.half("w", 1) - eb).abs() <= tol).all())


def test_one_rounding_moves_a_half_by_at_most_a_quarter_step_of_the_total():
    t = torch.tensor([3.0, 1e-20, 0.0, 7.0])
    d = torch.tensor([1.234567, -1e-20, 0.0, 7.0])
    h = HalfSums({"w": t}, {"w": HalfSums.encode(t, d)}, 1)
    exact_a = (t.double() + d.double()) / 2
    assert bool(((h.half("w", 0).double() - exact_a).abs() <= t.double() / (4 * FRAC_SCALE) + 1e-12).all())
    assert h.half("w", 1)[2] == 0 and h.half("w", 1)[3] == 0  # no total, and all mass in one half


def test_self_check_in_budget_sized_groups(tok, monkeypatch):
    """The check holds one tensor per parameter (autograd's gradient, negated, plus the engine's
    per-row gradients) for one group of parameters at a time. A float32 model's check fits the
    room of the accumulators not yet allocated: one group, one autograd and one engine pass. With
    the accumulators allocated and a tiny budget it runs in many groups and still accepts a
    supported model and refuses one whose gradients do not add up."""
    model = tiny_model("qwen3", seed=21)
    params = trainable_parameters(model)
    groups = check_groups(params, budget=8 * 600)
    assert len(groups) > 3 and [n for g in groups for n in g] == list(params)
    assert check_groups(params, budget=1 << 40) == [list(params)]
    # 4 bytes per float32 parameter: exactly the room of one group's float32 sums
    assert check_groups(params, new_store(model, 1).unallocated_bytes()) == [list(params)]
    monkeypatch.setattr(estimators, "budget_bytes", lambda mb, dev: 8 * 600)
    seen = []
    real = Store.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        if k.get("check_names") is not None:
            seen.append(set(k["check_names"]))
    monkeypatch.setattr(Store, "__init__", spy)
    roll = _roll(model, tok, seed=2)
    fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    assert seen == [set(params)]  # the accumulators' room: one group

    seen.clear()
    model = tiny_model("qwen3", seed=22)  # not verified yet
    params = trainable_parameters(model)
    store = new_store(model, 1)
    first = next(iter(params))
    store.add(first, 0, torch.zeros(params[first].shape))  # allocated: no room to borrow
    per_sample_square_sums(model, roll.input_ids, roll.attention_mask, roll.completion_mask, into=store)
    expected = check_groups(params, 8 * 600)
    assert len(expected) >= 2
    assert len(seen) == len(expected) and set().union(*seen) == set(params)

    bad = tiny_model("qwen3", seed=23)
    h = bad.config.hidden_size
    lin = torch.nn.Linear(h, h, bias=False)
    torch.nn.init.normal_(lin.weight, 0, 0.3)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = lin

        def forward(self, x):
            return torch.nn.functional.linear(x, self.inner.weight) + self.inner(x)
    bad.model.layers[1].mlp = Twice()
    with pytest.raises(UnsupportedModel, match="do not add up to autograd") as exc:
        fisher_from_samples(bad, roll.input_ids, roll.attention_mask, roll.completion_mask)
    assert "model.layers.1.mlp.inner.weight" in str(exc.value)


@pytest.mark.parametrize("tied", [False, True])
def test_self_check_holds_only_the_parameters_in_flight(tok, monkeypatch, tied):
    """The check's difference of a parameter is compared as soon as autograd's gradient arrives
    and dropped (issue 30: all of them alive at once, 4 bytes/param, made the check the job's peak
    at 100M): on an 8-layer model it never holds half of the parameters, and it still refuses a
    parameter used outside its module (the per-row gradients of one use only)."""
    model = tiny_model("qwen3", tied=tied, layers=8, seed=31)
    params = trainable_parameters(model)
    total = sum(p.numel() for p in params.values())
    held: list[int] = []
    real_add, real_rows = Store.add_check, Store.add_check_rows

    def add(self, name, grad_sum):
        real_add(self, name, grad_sum)
        held.append(sum(t.numel() for t in (self.check or {}).values()))

    def rows(self, name, index, r):
        real_rows(self, name, index, r)
        held.append(sum(t.numel() for t in (self.check or {}).values()))
    monkeypatch.setattr(Store, "add_check", add)
    monkeypatch.setattr(Store, "add_check_rows", rows)
    roll = _roll(model, tok, seed=4)
    fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    assert held and max(held) < total / 2, (max(held), total)

    bad = tiny_model("qwen3", tied=tied, layers=8, seed=32)
    inner = bad.model.layers[3].mlp.down_proj

    class Twice(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return self.mlp(x) + 0.5 * torch.nn.functional.linear(self.mlp.act_fn(self.mlp.gate_proj(x)), inner.weight)
    bad.model.layers[3].mlp = Twice(bad.model.layers[3].mlp)
    with pytest.raises(UnsupportedModel, match="do not add up to autograd") as exc:
        fisher_from_samples(bad, roll.input_ids, roll.attention_mask, roll.completion_mask)
    assert "model.layers.3.mlp.mlp.down_proj.weight" in str(exc.value)


@pytest.mark.parametrize("owned", [False, True])
def test_first_squares_are_written_not_added_and_match_a_zeroed_sum(owned):
    """The store writes a parameter's first squares (no zero-filled sums; an owned fresh tensor
    may become the sum itself): the same bits as adding them to zeros, later passes add, and a
    group no row reached is zero."""
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.rand(5, 7, generator=g) for _ in range(3))
    # compact (two float32 groups): total and int16 fraction as the zero-filled update gives
    st = Store({"w": torch.Size([5, 7])}, 2, torch.float32, torch.device("cpu"))
    st.add_groups("w", [(0, a.clone()), (1, b.clone())], owned=owned)
    st.add_groups("w", [(1, c.clone())], owned=owned)
    t0, q0 = torch.zeros(35), torch.zeros(35, dtype=torch.int16)
    acc_mod._update(t0, q0, [(0, a.reshape(-1)), (1, b.reshape(-1))])
    acc_mod._update(t0, q0, [(1, c.reshape(-1))])
    assert torch.equal(st.sums["w"].reshape(-1), t0) and torch.equal(st.frac["w"].reshape(-1), q0)
    # three float64 groups, only group 1 reached: groups 0 and 2 are zero, group 1 is a + c
    st = Store({"w": torch.Size([5, 7])}, 3, torch.float64, torch.device("cpu"))
    st.add_groups("w", [(1, a.double())], owned=owned)
    st.add_groups("w", [(1, c.double())], owned=owned)
    out = st.finish()["w"]
    assert torch.equal(out[0], torch.zeros(5, 7, dtype=torch.float64)) and torch.equal(out[2], out[0])
    assert torch.equal(out[1], a.double() + c.double())
    # one group: an owned first tensor is kept as the sum (no copy); not owned, it is copied
    st = Store({"w": torch.Size([5, 7])}, 1, torch.float32, torch.device("cpu"))
    first = a.clone()
    st.add_groups("w", [(0, first)], owned=owned)
    assert (st.sums["w"].data_ptr() == first.data_ptr()) is owned
    st.add_groups("w", [(0, b)], owned=owned)
    assert torch.equal(st.finish()["w"][0], a + b)


def test_a_halfs_sampled_values_are_its_slices_values_bit_for_bit():
    """HalfView.take (the split-half Jaccard's sample) makes the same bits as HalfView.chunks at
    the same positions: a bracket drawn from it is compared with the pass's own values."""
    g = torch.Generator().manual_seed(2)
    total = {"w": torch.rand(300, 40, generator=g), "v": torch.rand(500, generator=g)}
    diff = {"w": ((torch.rand(300, 40, generator=g) * 2 - 1) * 30000).round().to(torch.int16),
            "v": torch.rand(500, generator=g) * 0.1}  # one compact, one held as a float
    halves = HalfSums(total, diff, 1)
    for k in (0, 1):
        view = halves.view(k)
        flat = torch.cat(list(view.chunks(1000)))
        offset = 0
        for name in view:
            m = view.numel_of(name)
            idx = torch.randint(0, m, (77,), generator=g)
            assert torch.equal(view.take(name, idx).view(torch.int32), flat[offset:offset + m][idx].view(torch.int32))
            offset += m
