"""The series' fast paths against straightforward brute force: the fused C kernel
(compute.sparsity.series_kernel) and the numpy sweep on random tensors with ties and values on the
thresholds, and the Fisher AUC (per-tensor rank sums) against pairwise Mann-Whitney with ties
counted one half."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from compute.sparsity import series_kernel
from compute.sparsity.diff import lower_precision
from compute.sparsity.masks import group_key, topk_mask
from compute.sparsity.series import (
    SeriesConfig,
    bf16_round_threshold,
    checkpoint_series,
    tensor_counts,
)

ATOL = 1e-5
PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
         (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]


def _tied_pair(n: int, cur_dtype: torch.dtype, ref_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ref and cur with many equal coordinates, +0 against -0, deltas exactly at float32(atol),
    at the bf16 threshold and one float32 step either side of both, tiny and large deltas."""
    g = torch.Generator().manual_seed(seed)
    ref = (torch.randn(n, generator=g) * 0.02).to(ref_dtype)
    r32 = ref.float()
    t16, _ = bf16_round_threshold(ATOL)
    a32 = torch.tensor(ATOL, dtype=torch.float32)
    t32 = torch.tensor(t16, dtype=torch.float32)
    steps = torch.stack([torch.zeros(()), a32, t32, torch.nextafter(a32, torch.tensor(1.0)),
                         torch.nextafter(a32, torch.tensor(0.0)), torch.nextafter(t32, torch.tensor(1.0)),
                         torch.nextafter(t32, torch.tensor(0.0)), torch.tensor(3e-6), torch.tensor(1e-4),
                         torch.tensor(0.5)])
    pick = torch.randint(0, len(steps), (n,), generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    keep = torch.rand(n, generator=g) < 0.4  # 40% exactly equal
    cur32 = torch.where(keep, r32, r32 + sign * steps[pick])
    zeros = torch.rand(n, generator=g) < 0.05  # +0 against -0 (equal as numbers)
    cur32 = torch.where(zeros, torch.zeros(n), cur32)
    ref = torch.where(zeros, torch.full((n,), -0.0), r32).to(ref_dtype)
    small = torch.rand(n, generator=g) < 0.1  # weights near atol: the deltas land on both sides of it
    cur32 = torch.where(small, torch.full((n,), ATOL) * torch.randint(0, 3, (n,), generator=g), cur32)
    return cur32.to(cur_dtype), ref


def _brute(cur: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """compute.sparsity.diff's definitions, written out in PyTorch."""
    delta = cur.float() - ref.float()
    return {
        "unchanged_exact": float((cur == ref).sum()),
        "unchanged_bf16": float((cur.bfloat16() == ref.bfloat16()).sum()),
        "unchanged_atol": float((delta.abs() <= ATOL).sum()),
        "unchanged_bf16delta_atol": float(((cur.bfloat16() - ref.bfloat16()).abs() <= ATOL).sum()),
        "sq_sum": float(delta.double().square().sum()),
        "max_abs": float(delta.abs().max()),
    }


@pytest.mark.parametrize(("cur_dtype", "ref_dtype"), PAIRS)
@pytest.mark.parametrize("kernel", [False, True])
def test_counts_equal_brute_force_on_ties(cur_dtype: torch.dtype, ref_dtype: torch.dtype, kernel: bool) -> None:
    if kernel and series_kernel.kernel() is None:
        pytest.skip("no C compiler here: the numpy path is the one that runs (kernel=False case)")
    for n, seed in ((1, 0), (15, 1), (16, 2), (4099, 3), (70_001, 4)):  # ragged tails of the 16 lanes
        cur, ref = _tied_pair(n, cur_dtype, ref_dtype, seed)
        refs = [ref, cur.clone()]  # a second reference: identical to cur
        res = tensor_counts(cur, refs, ATOL, kernel=kernel, chunk=None if kernel else 4096)
        for (st, _), r in zip(res, refs, strict=True):
            want = _brute(cur, r)
            for k in ("unchanged_exact", "unchanged_bf16", "unchanged_atol", "unchanged_bf16delta_atol", "max_abs"):
                assert st[k] == want[k], (n, k, st[k], want[k])
            # float64 lanes (kernel) are within rounding of the float64 sum; float32 chunk dots (numpy) near it
            assert st["sq_sum"] == pytest.approx(want["sq_sum"], rel=1e-12 if kernel else 1e-6, abs=0), n
            # issue 27: changed and the sync's values in the lower of the two stored precisions
            low = lower_precision(cur.dtype, r.dtype)
            common = float((cur.to(low) == r.to(low)).sum())
            assert st["unchanged_common"] == common
            item = torch.empty((), dtype=low).element_size()
            assert st["sparse_bytes"] == (n - common) * (4 + item)
            assert st["sync_bytes"] == min(st["sparse_bytes"], n * cur.element_size())


def test_kernel_and_numpy_agree_on_every_count() -> None:
    if series_kernel.kernel() is None:
        pytest.skip("no C compiler here")
    for (cd, rd), seed in zip(PAIRS, itertools.count(10)):
        cur, ref = _tied_pair(50_003, cd, rd, seed)
        a = tensor_counts(cur, [ref], ATOL, kernel=True)[0][0]
        b = tensor_counts(cur, [ref], ATOL, kernel=False)[0][0]
        sums = ("sq_sum", "sq_common")
        assert {k: v for k, v in a.items() if k not in sums} == {k: v for k, v in b.items() if k not in sums}
        assert a["sq_sum"] == pytest.approx(b["sq_sum"], rel=1e-6)


def _pairwise_auc(score: torch.Tensor, labels: torch.Tensor) -> float:
    """Mann-Whitney by counting: P(score_pos > score_neg) + 1/2 P(equal)."""
    pos, neg = score[labels].double(), score[~labels].double()
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).double().sum() + 0.5 * (diff == 0).double().sum()) / (pos.numel() * neg.numel()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", ["1", "0"])
def test_fisher_auc_with_ties_equals_pairwise_mann_whitney(tmp_path: Path, dtype: torch.dtype, kernel: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths: the C kernel's integer rank sums and the numpy / PyTorch float64 ones."""
    if kernel == "1" and series_kernel.kernel() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("FISHERLENS_SERIES_KERNEL", kernel)
    g = torch.Generator().manual_seed(7)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (24, 16), "model.layers.0.mlp.up_proj.weight": (32, 16),
              "model.layers.1.self_attn.q_proj.weight": (24, 16), "model.norm.weight": (16,)}
    w = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    fisher = {n: torch.randint(0, 4, s, generator=g).float() for n, s in shapes.items()}  # 4 values: ties everywhere
    folders = [tmp_path / "base"] + [tmp_path / "run" / f"checkpoint-{k}" for k in (1, 2)]
    states = [w]
    for _ in (1, 2):
        states.append({n: t + (torch.rand(t.shape, generator=g) < 0.3) * torch.randn(t.shape, generator=g) * 1e-3
                       for n, t in states[-1].items()})
    for f, sd in zip(folders, states, strict=True):
        f.mkdir(parents=True)
        save_file({n: t.to(dtype).contiguous() for n, t in sd.items()}, str(f / "model.safetensors"))
        (f / "config.json").write_text("{}")
    res = checkpoint_series(folders[0], tmp_path / "run", fisher=fisher, config=SeriesConfig(auc_cap=100_000))
    assert res.settings["fisher"]["auc_sampled"] is False
    stored = [{n: t.to(dtype) for n, t in sd.items()} for sd in states]
    for i, point in enumerate(res.points):
        for pair, ref in (("vs_base", stored[0]), ("vs_prev", stored[i])):
            changed = {n: (stored[i + 1][n] != ref[n]).flatten() for n in shapes}
            for grouping in ("global", "layer", "module", "layer_module"):
                groups: dict[str, list[str]] = {}
                for n in shapes:
                    groups.setdefault(group_key(n, grouping), []).append(n)
                for gname, ms in groups.items():
                    score = torch.cat([fisher[n].flatten() for n in ms])
                    labels = torch.cat([changed[n] for n in ms])
                    want = _pairwise_auc(score, labels)
                    got = point[pair][grouping][gname]["auc"]
                    assert got == pytest.approx(want, rel=1e-12, nan_ok=True), (i, pair, grouping, gname)
            # the fixed support (the Fisher's top-k, ties by position): its changed coordinates
            support = topk_mask(fisher, res.settings["fisher"]["k"])
            sup = point[pair]["global"]["all"]
            assert sup["support_size"] == res.settings["fisher"]["k"]
            assert sup["support_changed"] == sum(int((changed[n] & support[n].flatten()).sum()) for n in shapes)


def test_no_compiler_falls_back_to_numpy_with_the_same_counts(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A compiler that fails (here /bin/false as CC): kernel() is None, a warning says why, and
    tensor_counts gives the brute-force counts through numpy; kernel=True refuses clearly."""
    monkeypatch.setattr(series_kernel, "_tried", False)
    monkeypatch.setattr(series_kernel, "_lib", None)
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level("WARNING", logger="compute.sparsity.series_kernel"):
        assert series_kernel.kernel() is None
    assert "series kernel unavailable" in caplog.text and "/bin/false failed" in caplog.text
    cur, ref = _tied_pair(3001, torch.bfloat16, torch.float32, 5)
    st = tensor_counts(cur, [ref], ATOL)[0][0]
    want = _brute(cur, ref)
    for k in ("unchanged_exact", "unchanged_bf16", "unchanged_atol", "unchanged_bf16delta_atol", "max_abs"):
        assert st[k] == want[k], k
    with pytest.raises(RuntimeError, match="series kernel is not available"):
        tensor_counts(cur, [ref], ATOL, kernel=True)
