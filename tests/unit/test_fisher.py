"""compute.fisher: the engine is exact against one backward per sample, on Qwen3, Llama and GPT-2
(Conv1D), tied and untied, with padding; the exact output-layer Fisher; hooks never leak."""

from __future__ import annotations

import pytest
import torch

from compute.fisher import (
    FisherConfig,
    batch_fisher,
    estimate_fisher,
    exact_output_fisher,
    expand_tokens,
    fisher_from_samples,
    fisher_sums,
    trainable_parameters,
)
from compute.lm.sampling import build_rollout, sample_completions
from tests.unit.fisher_tiny import char_tokenizer, tiny_model

ARCHS = [("qwen3", False), ("qwen3", True), ("llama", False), ("llama", True), ("gpt2", False),
         ("gpt2", True)]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def naive_fisher(model, ids, am, cm, estimator="sequence", weights=None):
    """Reference: one forward/backward per sample (per row, or per token), unpadded, float64."""
    params = trainable_parameters(model)
    out = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in params.items()}
    total = 0.0
    for r in range(ids.shape[0]):
        n = int(am[r].sum())
        x = ids[r : r + 1, :n]
        pos = [t for t in range(1, n) if cm[r, t]]
        samples = [pos] if estimator == "sequence" else [[t] for t in pos]
        w = 1.0 if weights is None else float(weights[r])
        for group in samples:
            lp = model(input_ids=x).logits[0].double().log_softmax(-1)
            s = sum(lp[t - 1, x[0, t]] for t in group)
            grads = torch.autograd.grad(s, list(params.values()), allow_unused=True)
            for name, g in zip(params, grads, strict=True):
                if g is not None:
                    out[name] += w * g.double() ** 2
            total += w
    return {n: v / total for n, v in out.items()}


def _rollout(model, tok, samples=2, max_new=5, seed=1):
    # prompts of different lengths: padding inside every batch
    return sample_completions(model, tok, ["1+2=", "123*45=", "7="], samples, max_new, seed=seed)


def _assert_fisher_close(got, ref, rtol=1e-4, atol_frac=1e-5):
    assert set(got) == set(ref)
    for n in ref:
        r = ref[n].to(got[n].dtype)
        assert got[n].shape == r.shape, n
        scale = float(r.abs().max())
        torch.testing.assert_close(got[n], r, rtol=rtol, atol=atol_frac * scale + 1e-12, msg=n)


@pytest.mark.parametrize("arch,tied", ARCHS)
def test_sequence_exact_float32(tok, arch, tied):
    model = tiny_model(arch, tied=tied)
    roll = _rollout(model, tok)
    assert (roll.attention_mask == 0).any()  # padded
    got = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    assert all(v.dtype == torch.float32 for v in got.values())
    assert set(got) == {n for n, _ in model.named_parameters()}
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    _assert_fisher_close(got, ref)
    if tied:  # the shared matrix really carries both uses (else the test would be vacuous)
        emb = model.get_input_embeddings().weight
        assert emb is model.get_output_embeddings().weight


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("gpt2", False), ("llama", False)])
def test_sequence_exact_float64(tok, arch, tied):
    model = tiny_model(arch, tied=tied).double()
    roll = _rollout(model, tok, seed=3)
    sums, denom = fisher_sums(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    got = {n: s.sum(0) / float(denom.sum()) for n, s in sums.items()}
    assert all(v.dtype == torch.float64 for v in got.values())
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    _assert_fisher_close(got, ref, rtol=1e-9, atol_frac=1e-11)


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("qwen3", True), ("gpt2", True)])
def test_token_exact(tok, arch, tied):
    model = tiny_model(arch, tied=tied)
    roll = _rollout(model, tok, seed=2)
    got = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                              estimator="token")
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask, "token")
    _assert_fisher_close(got, ref)


def test_expand_tokens_layout():
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 9, 1, 0, 0]])
    am = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    cm = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.bool)
    e_ids, e_am, e_cm, src = expand_tokens(ids, am, cm)
    assert src.tolist() == [0, 0, 1, 1]
    assert e_am.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert e_cm.nonzero()[:, 1].tolist() == [2, 3, 1, 2]
    assert (e_ids[e_am.bool()] == ids[src][e_am.bool()]).all()


def test_weights_match_weighted_naive(tok):
    model = tiny_model("llama", tied=True, seed=4)
    roll = _rollout(model, tok, seed=4)
    w = torch.tensor([0.5, 2.0, 0.0, 1.0, 3.0, 0.25])
    got = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                              weights=w)
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask, weights=w)
    _assert_fisher_close(got, ref)
    with pytest.raises(ValueError, match="^weights:"):
        fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                            weights=-w)


def test_chunking_does_not_change_result(tok):
    """A tiny memory budget (one row per matmul chunk) and batch_size=1 give the same Fisher."""
    model = tiny_model("gpt2", tied=True, seed=5)
    roll = _rollout(model, tok, seed=5)
    a = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    b = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                            memory_budget_mb=0, batch_size=1)
    _assert_fisher_close(b, a, rtol=1e-5, atol_frac=1e-6)


def test_frozen_parameters_are_skipped(tok):
    model = tiny_model("qwen3", seed=6)
    for n, p in model.named_parameters():
        if ".layers.0." in n or "embed" in n:
            p.requires_grad_(False)
    roll = _rollout(model, tok)
    got = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    assert set(got) == set(trainable_parameters(model))
    assert not any(".layers.0." in n for n in got)
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    _assert_fisher_close(got, ref)


def test_failure_inside_forward_leaves_no_hooks(tok):
    model = tiny_model("qwen3", seed=7)
    roll = _rollout(model, tok)
    layer = model.model.layers[1].mlp

    def boom(module, args, output):
        raise RuntimeError("boom")

    h = layer.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    h.remove()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_hooks_with_kwargs, type(m).__name__
    # and the model still works normally afterwards
    got = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    assert all(torch.isfinite(v).all() for v in got.values())
    assert all(p.grad is None for p in model.parameters())  # the engine never fills .grad


def test_failure_inside_backward_leaves_no_hooks(tok):
    from compute.fisher import UnsupportedModel

    model = tiny_model("gpt2", seed=8)
    roll = _rollout(model, tok)

    def raise_in_backward(module, args, output):
        def bad(grad):
            raise RuntimeError("bwd")

        if output.requires_grad:  # the engine's no-grad position check runs forward only
            output.register_hook(bad)

    h = model.transformer.h[0].ln_1.register_forward_hook(raise_in_backward)
    # the engine reports any failure inside a model's forward/backward as UnsupportedModel
    # (a refusal naming the cause), never a bare RuntimeError
    with pytest.raises(UnsupportedModel, match="bwd"):
        fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    h.remove()
    assert not any(m._forward_hooks or m._forward_hooks_with_kwargs for m in model.modules())


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("llama", True)])
def test_batch_estimator_matches_manual(tok, arch, tied):
    """Each gradient is squared as autograd accumulates it (a tied weight once, both uses
    summed first), and the model's own .grad are left as they were."""
    model = tiny_model(arch, tied=tied, seed=9)
    roll = build_rollout(tok, ["1+2=", "3*3=", "10+5="], ["3", "9", "15"])
    first = next(model.parameters())
    first.grad = torch.full_like(first, 7.0)
    got = batch_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                       batch_size=2)
    assert torch.equal(first.grad, torch.full_like(first, 7.0))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    first.grad = None
    params = trainable_parameters(model)
    ref = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in params.items()}
    for rows in ([0, 1], [2]):
        loss = 0
        for r in rows:
            n = int(roll.attention_mask[r].sum())
            x = roll.input_ids[r : r + 1, :n]
            lp = model(input_ids=x).logits[0].double().log_softmax(-1)
            loss = loss - sum(lp[t - 1, x[0, t]] for t in range(1, n) if roll.completion_mask[r, t])
        grads = torch.autograd.grad(loss / len(rows), list(params.values()))
        for name, g in zip(params, grads, strict=True):
            ref[name] += g.double() ** 2
    _assert_fisher_close(got, ref)


# ---- the exact output-layer Fisher ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_exact_output_fisher_equals_full_enumeration(tok, arch):
    """Enumerate every next token y at one position, weight by p(y): the sequence estimator
    then IS the expectation, and must equal the closed form sum p(1-p) h^2 exactly."""
    model = tiny_model(arch, tied=False, seed=10).double()
    prompt = tok("12+34=")["input_ids"]
    V = model.config.vocab_size
    ids = torch.tensor([prompt + [y] for y in range(V)])
    am = torch.ones_like(ids)
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[:, -1] = True
    with torch.no_grad():
        p = model(input_ids=ids[:1, :-1]).logits[0, -1].softmax(-1)  # (V,)
    sums, denom = fisher_sums(model, ids, am, cm, weights=p)
    head_name = "lm_head.weight"
    mc = sums[head_name].sum(0) / float(denom.sum())
    exact = exact_output_fisher(model, ids[:1], am[:1], cm[:1])[head_name]
    torch.testing.assert_close(mc.float(), exact, rtol=1e-6, atol=1e-9)
    exact_tok = exact_output_fisher(model, ids[:1], am[:1], cm[:1], normalize="token")[head_name]
    torch.testing.assert_close(exact_tok, exact)  # one position: both normalisations agree


@pytest.mark.slow
def test_monte_carlo_converges_to_exact_output_fisher(tok):
    """Sequence and token MC estimates approach the closed form (relative L1 error shrinks)."""
    model = tiny_model("qwen3", tied=False, seed=11, layers=1)
    prompts = ["1+2=", "45*6="]
    name = "lm_head.weight"
    errs = {}
    for est in ("sequence", "token"):
        for n in (8, 256):
            roll = sample_completions(model, tok, prompts, n, 2, seed=12)
            f = fisher_from_samples(model, roll.input_ids, roll.attention_mask,
                                    roll.completion_mask, estimator=est)[name]
            exact = exact_output_fisher(model, roll.input_ids, roll.attention_mask,
                                        roll.completion_mask, normalize=est)[name]
            errs[est, n] = float((f - exact).abs().sum() / exact.abs().sum())
    for est in ("sequence", "token"):
        assert errs[est, 256] < 0.2, errs
        assert errs[est, 256] < 0.6 * errs[est, 8], errs


# ---- estimate_fisher / config --------------------------------------------------------------


def test_estimate_fisher_end_to_end(tok):
    model = tiny_model("qwen3", seed=13)
    cfg = FisherConfig(samples=2, max_new_tokens=4, seed=3)
    prompts = ["1+2=", "33*4=", "5=", "8+8="]
    calls = []
    res = estimate_fisher(model, tok, prompts, cfg, progress=lambda f, m="": calls.append(f))
    assert res.n_rows == 8 and res.n_samples == 8 and res.estimator == "sequence"
    assert calls[0] == 0.0 and calls[-1] == 1.0 and calls == sorted(calls)
    roll = res.rollout
    ref = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    _assert_fisher_close(res.fisher, ref, rtol=1e-5, atol_frac=1e-6)
    # halves: prompts 0,2 vs 1,3; their weighted mean is the full Fisher
    d0, d1 = res.half_denoms
    assert (d0, d1) == (4.0, 4.0)
    for n in ref:
        torch.testing.assert_close((res.half(0)[n] * d0 + res.half(1)[n] * d1) / 8, res.fisher[n])
    # reproducible
    res2 = estimate_fisher(model, tok, prompts, cfg)
    assert all(torch.equal(res.fisher[n], res2.fisher[n]) for n in ref)


def test_estimate_fisher_empirical_needs_answers(tok):
    model = tiny_model("qwen3", seed=14)
    with pytest.raises(ValueError, match="^estimator:"):
        estimate_fisher(model, tok, ["1+2="], FisherConfig(estimator="empirical"))


@pytest.mark.parametrize("kw,field", [
    ({"estimator": "nope"}, "estimator"), ({"samples": 0}, "samples"),
    ({"temperature": 0.0}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"batch_size": 0}, "batch_size"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        FisherConfig(**kw)
    assert FisherConfig.model_fields["samples"].description


class SquaredScaleNorm(torch.nn.Module):
    """Not affine in its weight (y = x * w^2): the norm shortcut must detect it and fall back."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, hidden_states):
        return hidden_states * self.weight**2


def test_non_affine_module_uses_exact_generic_path(tok):
    model = tiny_model("qwen3", seed=15)
    model.model.norm = SquaredScaleNorm(model.config.hidden_size)
    roll = _rollout(model, tok, seed=6)
    got = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    _assert_fisher_close(got, ref)
    from compute.fisher.accumulate import AFFINE_OK as _AFFINE_OK

    assert _AFFINE_OK[model.model.norm] is False
    assert _AFFINE_OK[model.model.layers[0].input_layernorm] is True


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("gpt2", False)])
def test_row_loop_path_exact(tok, arch, tied, monkeypatch):
    """Large weights take the one-row-at-a-time path; force it on the tiny models."""
    import compute.fisher.persample as fisher_mod

    monkeypatch.setattr(fisher_mod, "SMALL_BATCHED", 0)
    model = tiny_model(arch, tied=tied, seed=16)
    roll = _rollout(model, tok, seed=7)
    got = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    _assert_fisher_close(got, ref)


# --------------------------------------------------------------------------------------------
# Never silently wrong: padding sides, refusals, scaled embeddings, exact-output check
# --------------------------------------------------------------------------------------------


def _left_padded(ids, am, cm):
    """The same rows, left-padded."""
    L = ids.shape[1]
    out = [torch.zeros_like(t) for t in (ids, am, cm)]
    for r in range(ids.shape[0]):
        n = int(am[r].sum())
        for src, dst in zip((ids, am, cm), out, strict=True):
            dst[r, L - n :] = src[r, :n]
    return tuple(out)


@pytest.mark.parametrize("estimator", ["sequence", "token"])
def test_left_padding_with_small_batches_equals_reference(tok, estimator):
    model = tiny_model("qwen3", seed=21)
    roll = _rollout(model, tok, seed=8)
    ids, am, cm = _left_padded(roll.input_ids, roll.attention_mask, roll.completion_mask)
    assert (am[:, 0] == 0).any()  # really left-padded
    got = fisher_from_samples(model, ids, am, cm, estimator=estimator, batch_size=2)
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask, estimator)
    _assert_fisher_close(got, ref)


def test_completion_mask_on_padding_is_refused(tok):
    model = tiny_model("qwen3", seed=22)
    ids = torch.tensor([[5, 6, 7, 0]])
    am = torch.tensor([[1, 1, 1, 0]])
    cm = torch.tensor([[0, 0, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="^completion_mask: counts padding"):
        fisher_from_samples(model, ids, am, cm)


class _OutsideUse(torch.nn.Module):
    """An MLP whose inner Linear's weight is read directly (as fused kernels do)."""

    def __init__(self, inner: torch.nn.Linear, also_call: bool):
        super().__init__()
        self.inner = inner
        self.also_call = also_call

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.inner.weight)
        return y + self.inner(x) if self.also_call else y


@pytest.mark.parametrize("also_call,phrase", [(False, "outside the forward of the module"),
                                              (True, "do not add up to autograd")])
def test_parameter_used_outside_its_module_is_refused(tok, also_call, phrase):
    from compute.fisher import UnsupportedModel

    model = tiny_model("qwen3", seed=23)
    h = model.config.hidden_size
    lin = torch.nn.Linear(h, h, bias=False)
    torch.nn.init.normal_(lin.weight, 0, 0.3)
    model.model.layers[1].mlp = _OutsideUse(lin, also_call)
    roll = _rollout(model, tok, seed=9)
    with pytest.raises(UnsupportedModel, match=phrase) as exc:
        fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    assert "model.layers.1.mlp.inner.weight" in str(exc.value)


def test_scaled_embedding_uses_gradient_before_scale(tok):
    from tests.unit.fisher_tiny import family_model

    model = family_model("gemma3", tied=False, seed=24)
    emb = model.get_input_embeddings()
    assert float(emb.embed_scale) == pytest.approx(model.config.hidden_size ** 0.5)
    roll = _rollout(model, tok, seed=10)
    got = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                              batch_size=2)
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
    _assert_fisher_close(got, ref)


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2"])
def test_exact_output_fisher_refuses_logit_transforms(tok, family):
    from compute.fisher import ExactOutputUnsupported
    from tests.unit.fisher_tiny import family_model

    model = family_model(family, tied=False, seed=25)
    roll = _rollout(model, tok, seed=11)
    with pytest.raises(ExactOutputUnsupported, match="not the output layer applied"):
        exact_output_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask)


def test_token_estimator_takes_the_rank1_path(tok, monkeypatch):
    import compute.fisher.persample as ps

    calls = []  # (in, out, conv1d) of every rank-1 weight
    real = ps.linear_rank1_square_sum

    def spy(*, x, g, pos, conv1d=False):
        calls.append((x.shape[-1], g.shape[-1], conv1d))
        return real(x=x, g=g, pos=pos, conv1d=conv1d)

    monkeypatch.setattr(ps, "linear_rank1_square_sum", spy)
    model = tiny_model("gpt2", seed=26)  # Conv1D blocks and an nn.Linear head
    roll = _rollout(model, tok, seed=12)
    got = fisher_from_samples(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                              estimator="token")
    d, V = model.config.n_embd, model.config.vocab_size
    assert (d, V, False) in calls  # lm_head
    assert (model.transformer.h[1].mlp.c_proj.weight.shape[0], d, True) in calls  # last c_proj
    ref = naive_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask, "token")
    _assert_fisher_close(got, ref)


def test_groups_without_rows_are_zero_and_row_order_does_not_matter(tok):
    model = tiny_model("qwen3", seed=27)
    roll = _rollout(model, tok, seed=13)
    N = roll.input_ids.shape[0]
    groups = torch.zeros(N, dtype=torch.long)  # group 1 of 2 gets no rows
    sums, denom = fisher_sums(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                              groups=groups, n_groups=2, batch_size=2)
    assert denom.tolist() == [float(N), 0.0]
    assert all(bool((s[1] == 0).all()) for s in sums.values())
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    again, _ = fisher_sums(model, roll.input_ids[perm], roll.attention_mask[perm],
                           roll.completion_mask[perm], groups=groups, n_groups=2)
    for n, s in sums.items():
        torch.testing.assert_close(again[n][0], s[0], rtol=1e-5, atol=1e-6 * float(s.max()))


def test_default_memory_budget_comes_from_free_memory():
    from compute.contract.cost import BUDGET_MAX_MB, BUDGET_MIN_MB
    from compute.lm.device import default_budget_mb, free_memory_bytes

    mb = default_budget_mb(torch.device("cpu"))
    assert BUDGET_MIN_MB <= mb <= BUDGET_MAX_MB
    assert mb <= max(BUDGET_MIN_MB, free_memory_bytes(torch.device("cpu")) // 2**20)
    assert FisherConfig().memory_budget_mb is None
    with pytest.raises(ValueError, match="^memory_budget_mb:"):
        FisherConfig(memory_budget_mb=8)
