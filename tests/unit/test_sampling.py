"""compute.lm.sampling: on-policy sampling is the model's own distribution, reproducible, and laid out
right-padded; token_logprobs matches a manual computation."""

from __future__ import annotations

import math

import pytest
import torch

from compute.lm.sampling import (
    _row_uniforms,
    build_rollout,
    filter_probs,
    sample_completions,
    sample_from_probs,
    token_logprobs,
)
from tests.unit.fisher_tiny import char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_sample_from_probs_matches_distribution_chi_square():
    # 20k draws from a fixed 6-way distribution (one zero-probability entry)
    p = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.1, 0.2])
    n = 20_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    draws = sample_from_probs(p.expand(n, -1), u)
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[2] == 0  # never a zero-probability token
    nz = p > 0
    expected = n * p.double()
    chi2 = (((counts - expected) ** 2)[nz] / expected[nz]).sum().item()
    assert chi2 < 20.5  # chi-square, 4 dof: P(chi2 > 20.5) < 0.0005


def test_sample_from_probs_edges():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 3)
    u = torch.tensor([0.0, 0.5, 1.0 - 1e-12], dtype=torch.float64)
    assert sample_from_probs(p, u).tolist() == [1, 2, 2]


def test_filter_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25]]))
    torch.testing.assert_close(filter_probs(logits), torch.tensor([[0.1, 0.5, 0.15, 0.25]]))
    torch.testing.assert_close(filter_probs(logits, top_k=2), torch.tensor([[0, 2 / 3, 0, 1 / 3]]))
    # top_p=0.6: 0.5 alone is < 0.6, so 0.25 is also kept; 0.75 >= 0.6 stops there
    torch.testing.assert_close(filter_probs(logits, top_p=0.6), torch.tensor([[0, 2 / 3, 0, 1 / 3]]))
    t2 = filter_probs(logits, temperature=2.0)
    ref = torch.softmax(logits / 2, -1)
    torch.testing.assert_close(t2, ref)


def test_first_token_frequencies_match_model(tok):
    """Many samples of the first completion token: frequencies match softmax(logits) (chi-square)."""
    model = tiny_model("qwen3", seed=1, hidden=8, layers=1)
    prompt = "12+3="
    n = 3000
    roll = sample_completions(model, tok, [prompt], samples=n, max_new_tokens=1, seed=5)
    p_len = len(tok(prompt)["input_ids"])
    first = roll.input_ids[:, p_len]
    with torch.no_grad():
        ids = torch.tensor([tok(prompt)["input_ids"]])
        probs = torch.softmax(model(input_ids=ids).logits[0, -1].double(), -1)
    counts = torch.bincount(first, minlength=probs.numel()).double()
    expected = n * probs
    keep = expected >= 5
    other_obs, other_exp = counts[~keep].sum(), expected[~keep].sum()
    chi2 = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum()
    if other_exp >= 5:
        chi2 = chi2 + (other_obs - other_exp) ** 2 / other_exp
    dof = int(keep.sum()) - (0 if other_exp >= 5 else 1)
    # generous bound: mean dof, sd sqrt(2 dof); 6 sd
    assert chi2.item() < dof + 6 * math.sqrt(2 * dof)


def _naive_sample(model, tok, prompt, key, seed, max_new_tokens):
    """Reference: full forward (no cache, no padding) per step with the row's own uniforms."""
    ids = list(tok(prompt)["input_ids"])
    u = _row_uniforms([key], seed, max_new_tokens)[0]
    out = []
    for step in range(max_new_tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[:, -1]
        t = int(sample_from_probs(filter_probs(logits), u[step : step + 1])[0])
        out.append(t)
        ids.append(t)
        if t == tok.eos_token_id:
            break
    return out


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt2"])
def test_kv_cache_left_padding_matches_naive_loop(tok, arch):
    model = tiny_model(arch, seed=2)
    prompts = ["1+2=", "123*45=", "9="]
    roll = sample_completions(model, tok, prompts, samples=2, max_new_tokens=7, seed=11)
    for row in range(len(roll)):
        p = int(roll.prompt_index[row])
        ref = _naive_sample(model, tok, prompts[p], (p, row % 2), 11, 7)
        got = roll.input_ids[row][roll.completion_mask[row]].tolist()
        assert got == ref, (arch, row)


def test_determinism_and_batch_independence(tok):
    model = tiny_model("qwen3", seed=3)
    prompts = ["1+2=", "33*4=", "5+5="]
    a = sample_completions(model, tok, prompts, 3, 6, seed=7)
    b = sample_completions(model, tok, prompts, 3, 6, seed=7, batch_size=2)
    assert torch.equal(a.input_ids, b.input_ids) and a.completions == b.completions
    c = sample_completions(model, tok, prompts, 3, 6, seed=8)
    assert not torch.equal(a.input_ids, c.input_ids)
    # a shard of the prompts (with its offset) reproduces the same rows
    d = sample_completions(model, tok, prompts[1:], 3, 6, seed=7, prompt_offset=1)
    sub = a.select(list(range(3, 9)))
    assert torch.equal(d.input_ids, sub.input_ids)
    assert torch.equal(d.prompt_index + 1, sub.prompt_index)


def test_padding_layout(tok):
    model = tiny_model("llama", seed=4)
    prompts = ["1=", "1234+5678="]
    roll = sample_completions(model, tok, prompts, 2, 5, seed=0)
    N, L = roll.input_ids.shape
    assert N == 4 and roll.prompt_index.tolist() == [0, 0, 1, 1]
    assert roll.attention_mask.dtype == torch.long and roll.completion_mask.dtype == torch.bool
    for r in range(N):
        am = roll.attention_mask[r]
        n_real = int(am.sum())
        assert am[:n_real].all() and not am[n_real:].any()  # right-padded
        assert (roll.input_ids[r, n_real:] == tok.pad_token_id).all()
        p_len = len(tok(prompts[int(roll.prompt_index[r])])["input_ids"])
        cm = roll.completion_mask[r]
        assert not cm[:p_len].any() and cm[p_len:n_real].all() and not cm[n_real:].any()
        comp = roll.input_ids[r][cm].tolist()
        assert 1 <= len(comp) <= 5
        # stops at eos: eos only as the last completion token
        assert tok.eos_token_id not in comp[:-1]
        assert roll.completions[r] == tok.decode(comp, skip_special_tokens=True)


def test_build_rollout(tok):
    roll = build_rollout(tok, ["1+2=", "10*10="], ["3", "100"])
    eos = tok.eos_token_id
    assert roll.input_ids[0].tolist()[:6] == tok("1+2=")["input_ids"] + tok("3")["input_ids"] + [eos]
    assert roll.completion_mask[1].nonzero().squeeze(1).tolist() == [6, 7, 8, 9]
    assert roll.attention_mask.sum(1).tolist() == [6, 10]
    assert roll.completions == ["3", "100"]
    no_eos = build_rollout(tok, ["1+2="], ["3"], add_eos=False)
    assert no_eos.completion_mask.sum().item() == 1
    with pytest.raises(ValueError, match="^completions:"):
        build_rollout(tok, ["1+2="], ["3", "4"])


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_token_logprobs_manual(tok, arch):
    model = tiny_model(arch, seed=5)
    roll = build_rollout(tok, ["1+2=", "77*8="], ["3", "616"])
    with torch.no_grad():
        lp = token_logprobs(model, roll.input_ids, roll.attention_mask)
    assert lp.shape == roll.input_ids.shape and lp.dtype == torch.float32
    for r in range(2):
        n = int(roll.attention_mask[r].sum())
        ids = roll.input_ids[r, :n]
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].double()
        manual = [0.0] + [
            (logits[t - 1].log_softmax(-1)[ids[t]]).item() for t in range(1, n)
        ]
        torch.testing.assert_close(lp[r, :n].double(), torch.tensor(manual, dtype=torch.float64),
                                   atol=1e-5, rtol=1e-5)
        assert (lp[r, n:] == 0).all()


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("llama", True), ("gpt2", True)])
def test_token_logprobs_through_the_split_head_equal_the_full_logits(tok, arch, tied, monkeypatch):
    """compute.lm.head: the real tokens' log-probs a chunk of 3 tokens at a time (checkpointed)
    equal the full-logits path in value and in every parameter's gradient, and the head never
    sees more than one chunk of tokens."""
    from compute.contract import cost
    from compute.lm.head import split_head

    model = tiny_model(arch, tied=tied, seed=7)
    roll = build_rollout(tok, ["1+2=", "77*8=", "5="], ["3", "616", "-11"])
    ids, am = roll.input_ids, roll.attention_mask
    full, _ = token_logprobs(model, ids, am, return_logits=True)  # the old path: model(...).logits
    (full * roll.completion_mask).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    monkeypatch.setattr(cost, "LOGITS_CHUNK_BYTES", 3 * 4 * model.config.vocab_size)  # 3 tokens a chunk
    assert split_head(model, ids, am, (am.cumsum(1) - 1).clamp(min=0)) is not None
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.shape[0]))
    lp = token_logprobs(model, ids, am)
    (lp * roll.completion_mask).sum().backward()
    hook.remove()
    torch.testing.assert_close(lp, full, atol=1e-5, rtol=1e-5)
    assert (lp[am == 0] == 0).all() and (lp[:, 0] == 0).all()
    real = int(am[:, 1:].sum())
    assert max(seen) == 3 and sum(seen) == 2 * real  # each chunk once forward, once recomputed
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-4, msg=n)


def test_a_head_with_logit_post_processing_takes_the_full_path(tok):
    """Gemma 2's soft-capping comes after the head: the split would be wrong, the check sees it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from compute.lm.head import split_head

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=0.5,
                       max_position_embeddings=64, pad_token_id=0)
    model = Gemma2ForCausalLM(cfg).eval()
    roll = build_rollout(tok, ["1+2="], ["3"])
    ids, am = roll.input_ids, roll.attention_mask
    assert split_head(model, ids, am, (am.cumsum(1) - 1).clamp(min=0)) is None
    with torch.no_grad():
        lp = token_logprobs(model, ids, am)
        logits = model(input_ids=ids).logits[0].double()
    n = ids.shape[1]
    manual = torch.tensor([0.0] + [logits[t - 1].log_softmax(-1)[ids[0, t]].item() for t in range(1, n)],
                          dtype=torch.float64)
    torch.testing.assert_close(lp[0].double(), manual, atol=1e-5, rtol=1e-5)
