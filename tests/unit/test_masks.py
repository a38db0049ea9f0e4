from __future__ import annotations

import pytest
import torch

from compute.sparsity.masks import (
    density_by,
    load_mask,
    mask_density,
    mask_metadata,
    n_keep,
    per_tensor_counts,
    save_mask,
    select_mask,
    topk_mask,
)


def _brute_topk(scores: dict[str, torch.Tensor], k: int, bottom: bool = False) -> dict[str, torch.Tensor]:
    """Reference: stable sort of all coordinates in (sorted name, flat index) order."""
    names = sorted(scores)
    flat = torch.cat([scores[n].flatten().double() for n in names])
    order = torch.sort(flat if bottom else -flat, stable=True).indices[:k]
    sel = torch.zeros(flat.numel(), dtype=torch.bool)
    sel[order] = True
    out, i = {}, 0
    for n in names:
        out[n] = sel[i : i + scores[n].numel()].view_as(scores[n])
        i += scores[n].numel()
    return out


def _scores(seed: int = 0, ties: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = {
        "model.layers.0.self_attn.q_proj.weight": torch.rand(6, 5, generator=g),
        "model.layers.1.mlp.up_proj.weight": torch.rand(4, 7, generator=g),
        "model.embed_tokens.weight": torch.rand(9, 3, generator=g),
        "model.norm.weight": torch.rand(5, generator=g),
    }
    if ties:  # quantise to create many exact ties, including across tensors
        s = {n: (t * 4).floor() / 4 for n, t in s.items()}
    return s


@pytest.mark.parametrize("density", [0.01, 0.1, 0.33, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("bottom", [False, True])
def test_global_topk_matches_brute_force_with_ties(density: float, bottom: bool) -> None:
    scores = _scores()
    total = sum(t.numel() for t in scores.values())
    k = n_keep(density, total)
    got = select_mask("fisher-bottom" if bottom else "fisher", density, scores=scores)
    want = _brute_topk(scores, k, bottom)
    assert sum(int(m.sum()) for m in got.values()) == k
    for n in scores:
        assert torch.equal(got[n], want[n]), n
    assert list(got) == list(scores)  # caller's key order


@pytest.mark.parametrize("bottom", [False, True])
def test_global_topk_in_slices_matches_brute_force_with_ties(monkeypatch, bottom: bool) -> None:
    """Issue 30: the selection reads each tensor in slices of KEY_CHUNK values (an 8B model's
    embedding is 622M of them); with slices of 4, ties at the threshold that span slices and
    tensors are still taken in (sorted name, flat index) order."""
    from compute.sparsity import masks

    monkeypatch.setattr(masks, "KEY_CHUNK", 4)
    scores = _scores(2)
    total = sum(t.numel() for t in scores.values())
    for density in (0.05, 0.3, 0.5, 0.8):
        k = n_keep(density, total)
        got = select_mask("fisher-bottom" if bottom else "fisher", density, scores=scores)
        want = _brute_topk(scores, k, bottom)
        assert all(torch.equal(got[n], want[n]) for n in scores), density
    with pytest.raises(ValueError, match="scores: NaN"):  # a NaN in a later slice is found too
        select_mask("fisher", 0.5, scores={"a": torch.tensor([1.0, 2, 3, 4, 5, float("nan")])})


def test_the_selection_reports_its_passes_tensor_by_tensor() -> None:
    """The mask job's selection over a large Fisher is a minute on a CPU: it reports after each
    tensor of its three passes (global) or each tensor (per-tensor selectors), rising to 1, the
    same mask as without a listener."""
    scores = _scores(3)
    heard: list[float] = []
    got = select_mask("fisher", 0.2, scores=scores, progress=heard.append)
    assert len(heard) == 3 * len(scores) and heard == sorted(heard) and heard[-1] == 1.0
    assert heard[len(scores) - 1] == pytest.approx(1 / 3)  # the first pass ends a third of the way
    assert all(torch.equal(got[n], m) for n, m in select_mask("fisher", 0.2, scores=scores).items())
    heard.clear()
    select_mask("fisher-tensor", 0.2, scores=scores, progress=heard.append)
    assert heard == [(i + 1) / len(scores) for i in range(len(scores))]


def test_topk_negative_values_and_signed_zero() -> None:
    s = {"a": torch.tensor([-1.0, -0.0, 0.0, 2.0, -3.5, float("inf"), -float("inf")])}
    assert topk_mask(s, 3)["a"].tolist() == [False, True, False, True, False, True, False]
    # -0.0 and 0.0 tie, the earlier index wins
    assert topk_mask(s, 4)["a"].tolist() == [False, True, True, True, False, True, False]
    assert topk_mask(s, 2, bottom=True)["a"].tolist() == [False, False, False, False, True, False, True]


def test_nan_scores_rejected() -> None:
    with pytest.raises(ValueError, match="scores: NaN"):
        select_mask("fisher", 0.5, scores={"a": torch.tensor([1.0, float("nan")])})


def test_per_tensor_counts_exact_and_deterministic() -> None:
    shapes = {"a": (3,), "b": (3,), "c": (3,)}  # 9 coords, density 0.5 -> 5 (round half up of 4.5)
    counts = per_tensor_counts(shapes, 0.5)
    assert sum(counts.values()) == 5
    # each has 1.5 -> floor 1, remainder 2 goes to the first names in order (equal fractions)
    assert counts == {"a": 2, "b": 2, "c": 1}
    counts = per_tensor_counts({"x": (10,), "y": (3,)}, 0.25)  # 2.5 + 0.75 -> k = round(3.25) = 3
    assert counts == {"x": 2, "y": 1}


def test_fisher_tensor_keeps_top_within_each_tensor() -> None:
    scores = _scores(1)
    got = select_mask("fisher-tensor", 0.3, scores=scores)
    counts = per_tensor_counts({n: t.shape for n, t in scores.items()}, 0.3)
    total = sum(t.numel() for t in scores.values())
    assert sum(int(m.sum()) for m in got.values()) == n_keep(0.3, total)
    for n, t in scores.items():
        assert int(got[n].sum()) == counts[n]
        assert torch.equal(got[n], _brute_topk({n: t}, counts[n])[n])


def test_random_mask_exact_seeded_and_uniform_per_tensor() -> None:
    params = {n: torch.zeros_like(t) for n, t in _scores().items()}
    a = select_mask("random", 0.4, params=params, seed=3)
    b = select_mask("random", 0.4, params=params, seed=3)
    c = select_mask("random", 0.4, params=params, seed=4)
    counts = per_tensor_counts({n: t.shape for n, t in params.items()}, 0.4)
    for n in params:
        assert torch.equal(a[n], b[n])
        assert int(a[n].sum()) == counts[n]
    assert any(not torch.equal(a[n], c[n]) for n in params)
    # uniformity: over many seeds every coordinate of a tensor is picked about equally often
    freq = torch.zeros(30)
    for s in range(400):
        freq += select_mask("random", 0.2, params={"w": torch.zeros(30)}, seed=s)["w"].float()
    assert freq.sum() == 400 * 6
    assert freq.min() > 400 * 0.2 * 0.5 and freq.max() < 400 * 0.2 * 1.5


def test_magnitude_and_gradient_use_absolute_values() -> None:
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(4, 4, generator=g), "w2": torch.randn(8, generator=g)}
    k = n_keep(0.25, 24)
    mag = select_mask("magnitude", 0.25, params=params)
    want = _brute_topk({n: p.abs() for n, p in params.items()}, k)
    assert all(torch.equal(mag[n], want[n]) for n in params)
    low = select_mask("magnitude-bottom", 0.25, params=params)
    want = _brute_topk({n: p.abs() for n, p in params.items()}, k, bottom=True)
    assert all(torch.equal(low[n], want[n]) for n in params)
    grad = select_mask("gradient", 0.25, scores=params)
    assert all(torch.equal(grad[n], mag[n]) for n in params)


def test_model_params_and_old_call_order() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    fisher = {n: torch.rand_like(p) for n, p in model.named_parameters() if p.requires_grad}
    m1 = select_mask("fisher", 0.2, scores=fisher, params=model)
    m2 = select_mask(fisher, "fisher", 0.2, model)  # TEAM.md order: (scores, selector, density, model)
    m3 = select_mask("fisher", 0.2, scores=fisher, model=model)
    assert set(m1) == {"0.weight", "0.bias", "1.weight"}
    assert all(torch.equal(m1[n], m2[n]) and torch.equal(m1[n], m3[n]) for n in m1)
    assert sum(int(m.sum()) for m in m1.values()) == n_keep(0.2, 12 + 4 + 8)
    with pytest.raises(ValueError, match="scores: parameter '1.bias'"):
        select_mask("fisher", 0.2, scores={**fisher, "1.bias": torch.rand(2)}, params=model)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"selector": "nope", "density": 0.1}, "select: got 'nope'"),
        ({"selector": "fisher", "density": 0.0}, "density: got 0.0"),
        ({"selector": "fisher", "density": 1.5}, "density: got 1.5"),
        ({"selector": "fisher", "density": 0.1}, "needs scores"),
        ({"selector": "magnitude", "density": 0.1}, "needs the model"),
        ({"selector": "fisher", "density": 1e-6, "scores": {"a": torch.rand(10)}}, "keeps 0 of 10"),
    ],
)
def test_select_mask_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        select_mask(**kwargs)


def test_save_load_roundtrip_and_validation(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    mask = select_mask("random", 0.5, params=model, seed=1)
    path = save_mask(mask, tmp_path / "m" / "mask.safetensors", {"selector": "random", "seed": 1})
    back = load_mask(path, model=model)
    assert set(back) == set(mask) and all(torch.equal(back[n], mask[n]) for n in mask)
    assert all(t.dtype == torch.bool for t in back.values())
    meta = mask_metadata(path)
    assert meta["selector"] == "random" and float(meta["density"]) == pytest.approx(mask_density(mask))
    other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"mask: parameter '0.bias' has shape \[4\] in the mask but \[5\]"):
        load_mask(path, model=other)
    with pytest.raises(ValueError, match="mask: parameter '2.bias' is in the model but not in the mask"):
        load_mask(path, model=torch.nn.Sequential(model[0], model[1], torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="mask: file not found"):
        load_mask(tmp_path / "none.safetensors")


def test_density_by_groups() -> None:
    mask = {
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([True, False, False, False]),
        "model.layers.0.mlp.up_proj.weight": torch.tensor([True, True]),
        "model.layers.1.self_attn.q_proj.weight": torch.tensor([True, True, True, False]),
        "model.embed_tokens.weight": torch.tensor([False, False]),
    }
    assert mask_density(mask) == pytest.approx(6 / 12)
    assert density_by(mask, "layer")["0"]["density"] == pytest.approx(3 / 6)
    assert density_by(mask, "layer")["-"]["density"] == 0.0
    assert density_by(mask, "module")["q"]["density"] == pytest.approx(4 / 8)
    assert density_by(mask, "layer_module")["1/q"]["kept"] == 3.0
    assert density_by(mask, "global")["all"]["total"] == 12.0


# --------------------------------------------------------------------------------- job and CLI


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from tests.unit.fisher_tiny import char_tokenizer, tiny_model

    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", str(tmp_path))
    monkeypatch.setenv("FISHERLENS_HOME", str(tmp_path / "home"))
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path / "base")
    char_tokenizer().save_pretrained(tmp_path / "base")
    g = torch.Generator().manual_seed(0)
    fisher = {n: torch.rand(p.shape, generator=g) for n, p in model.named_parameters()}
    save_file(fisher, str(tmp_path / "fisher.safetensors"))
    return tmp_path, model, fisher


def test_run_mask_fisher_and_magnitude(model_dir) -> None:
    from compute.jobs.mask import MaskSpec
    from compute.jobs.mask_run import run

    root, model, fisher = model_dir
    trace: list[tuple[float, str]] = []
    res = run(MaskSpec(fisher=str(root / "fisher.safetensors"), select="fisher", density=0.1,
                       model=str(root / "base")), lambda f, m="": trace.append((f, m)))
    selecting = [f for f, m in trace if m.startswith("selecting fisher")]
    assert len(selecting) > 3 * len(fisher) and selecting == sorted(selecting)  # the passes, tensor by tensor
    assert selecting[0] == 0.5 and selecting[-1] == pytest.approx(0.8)
    mask = res.tensors["mask"]
    total = sum(p.numel() for p in model.parameters())
    assert res.summary["kept"] == n_keep(0.1, total) and res.summary["total"] == total
    want = select_mask("fisher", 0.1, scores=fisher)
    assert all(torch.equal(mask[n], want[n]) for n in want)
    kept_mass = sum(float(fisher[n][want[n]].sum()) for n in want) / sum(float(f.sum()) for f in fisher.values())
    assert res.summary["fisher_mass_kept"] == pytest.approx(kept_mass)
    hm = res.heatmaps[0]
    assert hm.name == "mask_density" and hm.y_labels == ["0", "1", "-"] and "q" in hm.x_labels
    assert {r.param for r in res.layer_stats} == set(fisher)
    mag = run(MaskSpec(select="magnitude", density=0.1, model=str(root / "base")))
    want = select_mask("magnitude", 0.1, params=model)
    assert all(torch.equal(mag.tensors["mask"][n], want[n]) for n in want)


def test_run_mask_gradient_and_errors(model_dir) -> None:
    from compute.jobs.artifact_files import local_file
    from compute.jobs.mask import MaskSpec
    from compute.jobs.mask_run import run, sft_gradient

    root, model, fisher = model_dir
    res = run(MaskSpec(select="gradient", density=0.05, model=str(root / "base"), prompts=4))
    grad = sft_gradient(str(root / "base"), "arithmetic", 4, 0, "cpu")
    assert sum(float(g.sum()) for g in grad.values()) > 0
    want = select_mask("gradient", 0.05, scores=grad)
    assert all(torch.equal(res.tensors["mask"][n], want[n]) for n in want)
    with pytest.raises(ValueError, match=r"fisher: 'job:12' is a job reference; job:N is resolved by app.services.refs"):
        run(MaskSpec(fisher="job:12", select="fisher"))  # the engine never resolves job:N itself
    with pytest.raises(ValueError, match="fisher: file not found"):
        run(MaskSpec(fisher=str(root / "nope.safetensors")))
    with pytest.raises(ValueError, match="needs a Fisher"):
        run(MaskSpec(select="fisher-tensor", model=str(root / "base")))
    assert local_file(str(root), "fisher") == (root / "fisher.safetensors").resolve()  # a folder holding one
    assert run(MaskSpec(fisher=str(root), select="random", density=0.5)).summary["kept"] == n_keep(
        0.5, sum(f.numel() for f in fisher.values()))


def test_cli_mask(model_dir) -> None:
    from click.testing import CliRunner

    from app.cli import main

    root, model, fisher = model_dir
    out = root / "m.safetensors"
    r = CliRunner().invoke(main, ["mask", "--fisher", str(root / "fisher.safetensors"), "--select",
                                  "fisher-tensor", "--density", "0.2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "Kept fraction:" in r.output and "selector fisher-tensor" in r.output, r.output
    mask = load_mask(out, model=model)
    assert sum(int(m.sum()) for m in mask.values()) == n_keep(0.2, sum(f.numel() for f in fisher.values()))
    assert mask_metadata(out)["select"] == "fisher-tensor"
    r = CliRunner().invoke(main, ["mask", "--select", "nope", "--out", str(out)])
    assert r.exit_code == 2 and "--select: got 'nope'" in r.output
    r = CliRunner().invoke(main, ["mask", "--select", "fisher", "--fisher", "job:3", "--out", str(out)])
    assert r.exit_code == 2 and "error: --fisher: job 3 does not exist" in r.output  # the CLI resolves job:N too


def test_compact_mask_is_read_a_chunk_of_rows_at_a_time(tmp_path, monkeypatch) -> None:
    """load_compact_mask reads each tensor a chunk of rows at a time (MASK_READ_CHUNK values, here
    40: several chunks per tensor, a row split across none), each from a mapping of its own, and
    gives the same indices as the whole tensor's; every-kept and none-kept tensors stay True /
    False; a tensor that is not bool is refused naming it."""
    from safetensors.torch import save_file

    from compute.sparsity import masks as M

    monkeypatch.setattr(M, "MASK_READ_CHUNK", 40)
    g = torch.Generator().manual_seed(0)
    dense = {"a.weight": torch.rand(37, 9, generator=g) < 0.1, "b.bias": torch.rand(101, generator=g) < 0.5,
             "c.weight": torch.ones(5, 7, dtype=torch.bool), "d.weight": torch.zeros(3, 3, dtype=torch.bool),
             "e.weight": torch.rand(2, 3, 50, generator=g) < 0.2}
    save_file(dense, str(tmp_path / "m.safetensors"))
    got = M.load_compact_mask(tmp_path / "m.safetensors")
    for n, m in dense.items():
        assert torch.equal(got[n], m), n
        want = torch.nonzero(m.reshape(-1)).reshape(-1)
        part = got.part(n)
        if isinstance(part, bool):
            assert part == bool(m.all()) and (part or not m.any())
        else:
            assert part.dtype == torch.int32 and torch.equal(part.long(), want)
    save_file({"a.weight": torch.ones(4, 4)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="'a.weight'.*expected bool"):
        M.load_compact_mask(tmp_path / "bad.safetensors")
