from __future__ import annotations

import pytest
import torch

from compute.studies.tokens import TokensConfig, scope_parameters, token_mechanism, token_sets

VOCAB = 12


def _model(arch: str = "qwen3", seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if arch == "qwen3":
        cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                          tie_word_embeddings=False, max_position_embeddings=32)
        model = Qwen3ForCausalLM(cfg)
    else:
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                         tie_word_embeddings=True, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    with torch.no_grad():  # larger weights than the HF init so the distribution is not flat
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    return model.eval()


def _brute(model, ids: torch.Tensor, layer: int | None = None):
    """g_v for every token by one autograd call each; p; per-coordinate position Fisher."""
    params = scope_parameters(model, layer)
    z = model(input_ids=ids).logits[0, -1]
    p = torch.softmax(z.detach().double(), -1)
    G = torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(z[v], list(params.values()), retain_graph=True)])
        for v in range(z.numel())
    ]).double()  # (V, D)
    gbar = (p[:, None] * G).sum(0)
    F = (p[:, None] * (G - gbar).pow(2)).sum(0)  # (D,)
    return G, p, F, params


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_trace_matches_fisher_engine_and_brute_force(arch: str) -> None:
    model = _model(arch)
    ids = torch.tensor([[3, 5, 7, 2]])
    res = token_mechanism(model, ids, TokensConfig(top_k=4, random_k=3, low_k=2), keep_fisher=True)
    G, p, F, params = _brute(model, ids)
    assert res.exact and res.covered_mass == pytest.approx(1.0)
    assert len(res.covered_ids) == VOCAB
    assert res.fisher_trace == pytest.approx(float(F.sum()), rel=1e-5)
    assert torch.allclose(res.probs.double(), p, atol=1e-6)
    # per-coordinate position Fisher, by tensor
    flat = torch.cat([res.position_fisher[n].reshape(-1) for n in params]).double()
    torch.testing.assert_close(flat, F, rtol=1e-4, atol=1e-9)
    # the Fisher engine, token estimator, over all V next tokens weighted by p
    from compute.fisher import fisher_from_samples

    L = ids.shape[1]
    inp = torch.cat([ids.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], 1)  # (V, L+1)
    cm = torch.zeros(VOCAB, L + 1, dtype=torch.bool)
    cm[:, -1] = True
    fisher = fisher_from_samples(model, inp, torch.ones_like(inp), cm, estimator="token",
                                 weights=p.float())
    assert res.fisher_trace == pytest.approx(sum(float(f.sum()) for f in fisher.values()), rel=1e-4)
    for n in params:
        assert res.tensor_fisher[n] == pytest.approx(float(fisher[n].sum()), rel=1e-3, abs=1e-10)


def test_cosines_contributions_by_brute_force() -> None:
    model = _model()
    ids = torch.tensor([[1, 4, 4, 9, 0]])
    cfg = TokensConfig(top_k=5, random_k=4, low_k=3, seed=1)
    res = token_mechanism(model, ids, cfg)
    G, p, F, _ = _brute(model, ids)
    gbar = (p[:, None] * G).sum(0)
    for ts in (res.top, res.random, res.low):
        g = G[ts.ids]
        cos = torch.nn.functional.cosine_similarity(g[:, None, :], g[None, :, :], dim=-1)
        torch.testing.assert_close(ts.cosine.double(), cos, atol=1e-5, rtol=1e-5)
        dev = (g - gbar).pow(2).sum(1)
        torch.testing.assert_close(torch.tensor(ts.deviation, dtype=torch.float64), dev, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(torch.tensor(ts.contrib, dtype=torch.float64), p[ts.ids] * dev, rtol=1e-4, atol=1e-12)
        torch.testing.assert_close(torch.tensor(ts.share, dtype=torch.float64), p[ts.ids] * dev / F.sum(), rtol=1e-4, atol=1e-12)
    n = len(res.top.ids)
    c = res.top.cosine.double()
    assert res.top.mean_offdiag_cosine() == pytest.approx(float((c.sum() - n) / (n * (n - 1))), abs=1e-5)
    # top tokens sorted by probability; shares over the full vocabulary sum to 1
    assert res.top.probs == sorted(res.top.probs, reverse=True)
    assert res.top.probs[0] == pytest.approx(float(p.max()))


def test_token_sets_disjoint_seeded() -> None:
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    cfg = TokensConfig(top_k=5, random_k=6, low_k=4, seed=3)
    top, rnd, low = token_sets(probs, cfg)
    assert top == torch.topk(probs, 5).indices.tolist()
    assert not set(top) & set(rnd) and not set(top) & set(low) and len(set(rnd)) == 6
    assert low == torch.topk(-probs, 4).indices.tolist()
    assert token_sets(probs, cfg)[1] == rnd
    assert token_sets(probs, TokensConfig(top_k=5, random_k=6, low_k=4, seed=4))[1] != rnd


def test_layer_scope_and_chunking_agree() -> None:
    model = _model()
    ids = torch.tensor([[2, 3]])
    full = token_mechanism(model, ids, TokensConfig(top_k=4, layer=1))
    G, p, F, params = _brute(model, ids, layer=1)
    assert set(params) == {n for n in params if ".layers.1." in n} and len(params) > 3
    assert full.n_params == G.shape[1] and full.scope == "layer 1"
    assert full.fisher_trace == pytest.approx(float(F.sum()), rel=1e-5)
    # a tiny memory budget splits the parameters into many chunks: same numbers
    # a tiny memory budget: streamed Fisher, Gram over many parameter chunks; same numbers
    small = token_mechanism(model, ids, TokensConfig(top_k=4, layer=1, memory_budget_mb=0.01),
                            method="loop")
    loop = token_mechanism(model, ids, TokensConfig(top_k=4, layer=1), method="loop")
    assert small.settings["mode"] == "stream" and loop.settings["mode"] == "gram"
    assert full.settings["mode"] == "factored"
    assert small.settings["parameter_chunks"] > 3 and loop.settings["parameter_chunks"] == 1
    assert small.fisher_trace == pytest.approx(full.fisher_trace, rel=1e-6)
    for a, b in ((small.top, full.top), (small.random, full.random), (small.low, full.low)):
        assert a.ids == b.ids
        torch.testing.assert_close(a.cosine, b.cosine, rtol=1e-5, atol=1e-6)
        assert a.contrib == pytest.approx(b.contrib, rel=1e-5, abs=1e-12)
        assert a.share == pytest.approx(b.share, rel=1e-5, abs=1e-12)
    assert small.tensor_fisher == pytest.approx(full.tensor_fisher, rel=1e-5)
    whole = token_mechanism(model, ids, TokensConfig(top_k=4, memory_budget_mb=0.01), keep_fisher=True)
    G, p, F, params = _brute(model, ids)
    flat = torch.cat([whole.position_fisher[n].reshape(-1) for n in params]).double()
    torch.testing.assert_close(flat, F, rtol=1e-4, atol=1e-9)
    assert whole.fisher_trace == pytest.approx(float(F.sum()), rel=1e-5)
    with pytest.raises(ValueError, match=r"layer: 7 is not a block of this model; accepted: 0..1"):
        token_mechanism(model, ids, TokensConfig(layer=7))


def test_large_vocabulary_covers_mass_and_states_it() -> None:
    model = _model()
    ids = torch.tensor([[5, 6, 7]])
    exact = token_mechanism(model, ids, TokensConfig(top_k=3))
    part = token_mechanism(model, ids, TokensConfig(top_k=3, full_vocab_max=4, mass_target=0.8, max_tokens=50))
    assert not part.exact
    assert part.covered_mass >= 0.8 and len(part.covered_ids) < VOCAB
    cum = torch.sort(part.probs.double(), descending=True).values.cumsum(0)
    assert len(part.covered_ids) == int((cum < 0.8).sum()) + 1
    assert part.fisher_trace < exact.fisher_trace
    # contributions of the covered tokens are exact (gbar is over the full vocabulary)
    torch.testing.assert_close(torch.tensor(part.top.contrib), torch.tensor(exact.top.contrib), rtol=1e-5, atol=0)
    capped = token_mechanism(model, ids, TokensConfig(top_k=3, full_vocab_max=4, mass_target=1.0, max_tokens=5))
    assert len(capped.covered_ids) == 5 and capped.covered_mass < 1.0


def _brute_counterfactual(G: torch.Tensor, p: torch.Tensor, top: list[int]) -> dict[str, float]:
    """trace F, F_orth and the removed part from the full (V, V) Gram matrix of g_v = dz_v/dtheta,
    written as in docs/science.md section 5 (double sums over the enumerated vocabulary)."""
    gram = G @ G.T  # (V, V) float64
    V = p.numel()
    t1 = sum(float(p[v] * gram[v, v]) for v in range(V))
    pair = sum(float(p[u] * p[v] * gram[u, v]) for u in range(V) for v in range(V))
    self_ = sum(float(p[v] ** 2 * gram[v, v]) for v in range(V))
    off_top = sum(float(p[u] * p[v] * gram[u, v]) for u in top for v in top if u != v)
    off_all = sum(float(p[u] * p[v] * gram[u, v]) for u in range(V) for v in range(V) if u != v)
    return {"trace_f": t1 - pair, "trace_f_orth": t1 - self_, "removed": off_all, "removed_top": off_top}


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_orthogonal_counterfactual_against_brute_force(arch: str) -> None:
    model = _model(arch, seed=1)
    ids = torch.tensor([[4, 1, 9]])
    G, p, F, _ = _brute(model, ids)
    for budget in (1024.0, 0.01):  # gram mode and stream mode
        res = token_mechanism(model, ids, TokensConfig(top_k=4, memory_budget_mb=budget))
        sim = res.similarity
        want = _brute_counterfactual(G, p, res.top.ids)
        assert sim["exact"]
        assert sim["trace_f"] == pytest.approx(float(F.sum()), rel=1e-5)  # = sum_i F_i (definition)
        assert sim["trace_f"] == pytest.approx(want["trace_f"], rel=1e-5)
        assert sim["trace_f_orth"] == pytest.approx(want["trace_f_orth"], rel=1e-5)
        assert sim["removed"] == pytest.approx(want["removed"], rel=1e-5, abs=1e-9)
        assert sim["removed"] == pytest.approx(sim["trace_f_orth"] - sim["trace_f"], rel=1e-6, abs=1e-9)
        assert sim["removed_share"] == pytest.approx(want["removed"] / want["trace_f_orth"], rel=1e-5, abs=1e-9)
        assert sim["removed_top"] == pytest.approx(want["removed_top"], rel=1e-5, abs=1e-9)
        assert sim["trace_f_orth_top"] == pytest.approx(want["trace_f"] + want["removed_top"], rel=1e-5)


def test_orthogonal_counterfactual_hand_computed() -> None:
    from compute.studies.tokens import counterfactual_orthogonal

    # two tokens with identical sensitivities (g_1 = g_2 = (1, 0)), p = (0.5, 0.5): F = 0, F_orth =
    # 0.5 * 1 + 0.5 * 1 - 0.25 - 0.25 = 0.5, all of it removed by the similarity.
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    gram = torch.ones(2, 2, dtype=torch.float64)
    out = counterfactual_orthogonal(p, gram.diagonal(), 1.0, True, 0.0, p, gram)
    assert out["trace_f"] == pytest.approx(0.0) and out["trace_f_orth"] == pytest.approx(0.5)
    assert out["removed"] == pytest.approx(0.5) and out["removed_share"] == pytest.approx(1.0)
    # opposite sensitivities (g_2 = -g_1): ||gbar|| = 0, F = 1 > F_orth = 0.5; similarity raises F
    gram = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    out = counterfactual_orthogonal(p, gram.diagonal(), 0.0, True, 1.0, p, gram)
    assert out["trace_f"] == pytest.approx(1.0) and out["removed"] == pytest.approx(-0.5)
    assert out["removed_share"] == pytest.approx(-1.0) and out["removed_top"] == pytest.approx(-0.5)


def test_orthogonal_counterfactual_bounds_when_the_vocabulary_is_not_enumerated() -> None:
    model = _model(seed=2)
    ids = torch.tensor([[5, 6, 7]])
    exact = token_mechanism(model, ids, TokensConfig(top_k=3)).similarity
    for budget in (1024.0, 0.01):
        part = token_mechanism(model, ids, TokensConfig(top_k=3, full_vocab_max=4, mass_target=0.7,
                                                        memory_budget_mb=budget)).similarity
        assert not part["exact"] and part["trace_f"] is None and part["removed"] is None
        assert part["trace_f_lower"] <= exact["trace_f"] * (1 + 1e-6)
        assert part["trace_f_orth_lower"] <= exact["trace_f_orth"] * (1 + 1e-6)
        assert part["removed_upper"] >= exact["removed"] - 1e-9
        if part["removed_share_upper"] is not None:
            assert part["removed_share_upper"] >= exact["removed_share"] - 1e-9
        assert part["removed_top"] == pytest.approx(exact["removed_top"], rel=1e-5, abs=1e-12)  # exact


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    from tests.unit.fisher_tiny import char_tokenizer, tiny_model

    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", str(tmp_path))
    monkeypatch.setenv("FISHERLENS_HOME", str(tmp_path / "home"))
    model = tiny_model("qwen3")
    tok = char_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return tmp_path / "m", model, tok


def test_run_tokens_job_and_cli(model_dir, tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from app.cli import main
    from compute.jobs.tokens import TokensSpec
    from compute.jobs.tokens_run import run

    path, model, tok = model_dir
    res = run(TokensSpec(model=str(path), context="12+3", top_k=4, random_k=3, low_k=2, device="cpu"))
    s = res.summary
    ids = torch.tensor([tok("12+3")["input_ids"]])
    direct = token_mechanism(model.eval(), ids, TokensConfig(top_k=4, random_k=3, low_k=2))
    assert s["fisher_trace"] == pytest.approx(direct.fisher_trace, rel=1e-5)
    assert [r["id"] for r in s["top_tokens"]] == direct.top.ids
    assert s["top_tokens"][0]["token"] == tok.decode([direct.top.ids[0]])
    assert s["fisher_exact"] and s["covered_mass"] == pytest.approx(1.0)
    assert sum(r.values["share"] for r in res.layer_stats) == pytest.approx(1.0, rel=1e-6)
    names = [h.name for h in res.heatmaps]
    assert names == ["similarity_top", "similarity_random", "similarity_low"]
    top = res.heatmaps[0]
    assert len(top.z) == 4 and top.z[0][0] == pytest.approx(1.0, abs=1e-5) and len(set(top.x_labels)) == 4
    assert s["mean_cosine_top"] == pytest.approx(direct.top.mean_offdiag_cosine(), abs=1e-6)
    out = tmp_path / "tok.json"
    r = CliRunner().invoke(main, ["tokens", "--model", str(path), "--context", "12+3", "--top-k", "4",
                                  "--layer", "0", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "Scope: layer 0" in r.output and "Mean off-diagonal cosine" in r.output, r.output
    assert "vs orthogonal sensitivities F_orth" in r.output and "Most likely next tokens" in r.output
    # trace F against orthogonal sensitivities: in the summary, the CLI and the view
    sim = s["similarity"]
    assert sim["exact"] and sim["trace_f"] == pytest.approx(s["fisher_trace"], rel=1e-5)
    assert sim["removed"] == pytest.approx(direct.similarity["removed"], rel=1e-5, abs=1e-12)
    from app.plots import result_figures

    figs = dict(result_figures(json.loads(json.dumps(res.to_dict()))))
    bars = figs["fisher_counterfactual"].data[0]
    assert list(bars.y) == pytest.approx([sim["trace_f"], sim["trace_f_orth"], sim["trace_f_orth_top"]])
    assert json.loads(out.read_text())["kind"] == "tokens"
    r = CliRunner().invoke(main, ["tokens", "--model", str(path), "--context", "12", "--layer", "9"])
    assert r.exit_code == 2 and "error: --layer: got 9; accepted range: >= 0, <= 1 (the model has 2 blocks)" in r.output
    r = CliRunner().invoke(main, ["tokens", "--model", str(path), "--context", "   "])
    assert r.exit_code == 2 and "--context" in r.output


@pytest.mark.slow
def test_zoo_tokens(zoo_home, monkeypatch) -> None:
    from compute.jobs.tokens import TokensSpec
    from compute.jobs.tokens_run import run

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    res = run(TokensSpec(model="arith-base", context="12+34=", top_k=4, random_k=4, low_k=4, device="cpu"))
    s = res.summary
    assert s["fisher_exact"] and s["covered_mass"] == pytest.approx(1.0)
    assert s["top_tokens"][0]["prob"] >= s["top_tokens"][-1]["prob"]
    assert {r["token"] for r in s["top_tokens"]} & set("0123456789")  # digits follow "="
    assert -1.0 <= s["mean_cosine_top"] <= 1.0


def _assert_same_result(a, b, rel: float = 1e-5) -> None:
    """Two TokensResults agree (float tolerance): sets, cosines, contributions, Fisher."""
    assert a.covered_ids == b.covered_ids and a.exact == b.exact
    assert a.fisher_trace == pytest.approx(b.fisher_trace, rel=rel)
    assert a.gbar_norm == pytest.approx(b.gbar_norm, rel=rel)
    for x, y in ((a.top, b.top), (a.random, b.random), (a.low, b.low)):
        assert x.ids == y.ids
        torch.testing.assert_close(x.cosine, y.cosine, rtol=rel, atol=1e-6)
        assert x.contrib == pytest.approx(y.contrib, rel=rel, abs=1e-12)
        assert x.deviation == pytest.approx(y.deviation, rel=rel, abs=1e-12)
        assert x.grad_norm == pytest.approx(y.grad_norm, rel=rel, abs=1e-12)
    assert a.tensor_fisher == pytest.approx(b.tensor_fisher, rel=rel, abs=1e-10 * b.fisher_trace)
    for k, v in b.similarity.items():
        if isinstance(v, float):
            assert a.similarity[k] == pytest.approx(v, rel=rel, abs=1e-9 * b.fisher_trace), k


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])  # gpt2: tied embeddings, Conv1D
@pytest.mark.parametrize("cfg", [
    TokensConfig(top_k=4, random_k=3, low_k=2),
    TokensConfig(top_k=3, full_vocab_max=4, mass_target=0.8, max_tokens=50),  # not enumerated
    TokensConfig(top_k=4, layer=1),
])
def test_factored_path_equals_the_per_token_loop(arch: str, cfg: TokensConfig) -> None:
    model = _model(arch)
    ids = torch.tensor([[3, 5, 7, 2]])
    fast = token_mechanism(model, ids, cfg)
    loop = token_mechanism(model, ids, cfg, method="loop")
    assert fast.settings["mode"] == "factored" and "fast_path_skipped" not in fast.settings
    assert loop.settings["mode"] == "gram"
    _assert_same_result(fast, loop)


class _DoubledHead(torch.nn.Linear):
    """A head whose weight is transformed inside forward: the factors (C^T x) do not model it."""

    def forward(self, x):
        return torch.nn.functional.linear(x, 2 * self.weight)


def test_factored_path_falls_back_when_autograd_disagrees() -> None:
    model = _model("qwen3")
    head = _DoubledHead(16, VOCAB, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    ids = torch.tensor([[3, 5, 7, 2]])
    res = token_mechanism(model, ids, TokensConfig(top_k=4))
    assert res.settings["mode"] == "gram"
    assert "lm_head.weight" in res.settings["fast_path_skipped"]
    _assert_same_result(res, token_mechanism(model, ids, TokensConfig(top_k=4), method="loop"))


def test_factored_path_equals_the_loop_on_a_zoo_model(zoo_home) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo_home / "zoo" / "arith-base"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    for cfg in (TokensConfig(top_k=4, random_k=4, low_k=4),
                TokensConfig(top_k=3, full_vocab_max=4, mass_target=0.9, max_tokens=6)):
        fast = token_mechanism(model, ids, cfg)
        assert fast.settings["mode"] == "factored"
        _assert_same_result(fast, token_mechanism(model, ids, cfg, method="loop"))
