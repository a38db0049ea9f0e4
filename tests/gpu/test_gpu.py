"""GPU readiness: the engine and the masked step on a CUDA device, in bf16 and float32.

Run on a GPU machine with one command:  pytest -m gpu tests/gpu
Every test also has a CPU variant (not marked gpu) that runs everywhere, so the test code itself
is exercised on machines without a GPU; the `cuda` variants skip when CUDA is absent.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from compute.fisher import fisher_from_samples, relative_error
from compute.lm.device import resolve_dtype
from tests.unit.fisher_tiny import VOCAB, family_model, tiny_model
from tests.unit.test_arch_matrix import _rows, reference, worst_error

CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]
# bf16 keeps 8 significant bits: squared gradients of a bf16 forward/backward differ from the
# float32 ones by a few percent (CPU, 3 seeds: global 0.015-0.028, worst tensor 0.025-0.051)
BF16_GLOBAL_TOL, BF16_TENSOR_TOL = 0.08, 0.25


def _batch(seed: int = 0, n: int = 6, L: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, L), generator=g)
    lens = torch.randint(L // 2, L + 1, (n,), generator=g)
    am = (torch.arange(L)[None] < lens[:, None]).long()
    cm = am.bool() & (torch.arange(L)[None] >= 3)
    return ids, am, cm


def _global_error(got: dict, ref: dict) -> float:
    num = sum(float((got[n].double() - ref[n].double()).abs().sum()) for n in ref)
    return num / sum(float(ref[n].double().abs().sum()) for n in ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("estimator", ["sequence", "token"])
def test_bf16_engine_matches_float32_reference(device, estimator):
    model32 = tiny_model("qwen3", hidden=32, seed=3).to(device)
    model16 = tiny_model("qwen3", hidden=32, seed=3, dtype=torch.bfloat16).to(device)
    ids, am, cm = _batch()
    ref = fisher_from_samples(model32, ids, am, cm, estimator=estimator, batch_size=4)
    got = fisher_from_samples(model16, ids, am, cm, estimator=estimator, batch_size=4)
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in got.values())
    glob = _global_error(got, ref)
    worst = max(relative_error(got[n], ref[n]) for n in ref)
    assert glob <= BF16_GLOBAL_TOL, f"bf16 vs float32: global relative L1 {glob:.3g}"
    assert worst <= BF16_TENSOR_TOL, f"bf16 vs float32: worst tensor relative L1 {worst:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3", "opt"])
def test_float32_engine_exact_on_device(device, family):
    warnings.filterwarnings("ignore")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # exactness needs true float32 matmuls
    model = family_model(family, tied=False, seed=4).to(device)
    ids, am, cm = _rows(left=True)
    got = fisher_from_samples(model, ids, am, cm, batch_size=2)
    refs = reference(model, ids, am, cm)  # float64 on the same device
    err, where = worst_error(got, {n: t.cpu() for n, t in refs["sequence"].items()})
    assert err <= 1e-5, f"{family} on {device}: {err:.3g} at {where}"


@pytest.mark.parametrize("device", DEVICES)
def test_masked_step_in_bf16_keeps_frozen_weights_bit_identical(device):
    from compute.train import MaskedOptimizer, mask_gradients, prepare_masked_params

    model = tiny_model("qwen3", hidden=32, seed=5, dtype=torch.bfloat16).to(device)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    mask = {n: (torch.rand(p.shape, generator=g) < 0.3).to(device)
            for n, p in model.named_parameters()}
    params = prepare_masked_params(model, mask)
    opt = MaskedOptimizer(params, "adamw", lr=1e-2, weight_decay=0.1)
    ids = torch.randint(3, VOCAB, (4, 8), generator=g).to(device)
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        mask_gradients(params)
        opt.step()
    moved = 0
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        frozen = ~mask[n]
        assert torch.equal(p.detach()[frozen], start[n][frozen]), n
        moved += int((p.detach()[mask[n]] != start[n][mask[n]]).sum())
    assert moved > 0


@pytest.mark.parametrize("device", DEVICES)
def test_auto_dtype_is_the_one_decision(device):
    want = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    assert resolve_dtype("auto", torch.device(device)) == want


@pytest.mark.parametrize("device", DEVICES)
def test_token_mechanism_factored_path_on_device(device):
    """compute.studies.tokens: the factored path equals the per-token loop in float32 on the device, and
    in bf16 it is taken (not skipped) and stays within bf16 drift of the float32 numbers."""
    from compute.studies.tokens import TokensConfig, token_mechanism

    cfg = TokensConfig(top_k=4, random_k=3, low_k=2)
    ids = torch.tensor([[3, 5, 7, 2, 9]], device=device)
    model32 = tiny_model("gpt2", hidden=32, tied=True, seed=4).to(device).eval()
    fast = token_mechanism(model32, ids, cfg)
    loop = token_mechanism(model32, ids, cfg, method="loop")
    assert fast.settings["mode"] == "factored" and "fast_path_skipped" not in fast.settings
    assert fast.fisher_trace == pytest.approx(loop.fisher_trace, rel=1e-5)
    torch.testing.assert_close(fast.top.cosine, loop.top.cosine, rtol=1e-5, atol=1e-6)
    model16 = tiny_model("gpt2", hidden=32, tied=True, seed=4, dtype=torch.bfloat16).to(device)
    half = token_mechanism(model16.eval(), ids, cfg)
    assert half.settings["mode"] == "factored", half.settings.get("fast_path_skipped")
    assert half.fisher_trace == pytest.approx(loop.fisher_trace, rel=BF16_GLOBAL_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fisher_job_device_memory_per_parameter(tmp_path, zoo_home, monkeypatch, dtype):
    """Issue 30 on a GPU: the Fisher job's peak device memory above its loaded weights stays within
    6 bytes/param beyond its temporaries budget (and a fixed part for the CUDA context's kernels and
    sampling), on a 50M-parameter random Llama with tied embeddings, split-half and the self-check
    on. The CPU twin is tests/unit/test_fisher_memory.py."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from compute.jobs import fisher_run
    from compute.jobs.fisher import FisherSpec

    folder = tmp_path / "m50"
    cfg = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                      max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok = zoo_home / "zoo" / "arith-base"
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder)
    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", str(tmp_path))
    budget_mb = 256
    spec = FisherSpec(model=str(folder), prompts=8, samples=4, max_new_tokens=16, device="cuda",
                      dtype=dtype, memory_budget_mb=budget_mb)
    loaded = fisher_run._load(spec, None)
    n = sum(p.numel() for p in loaded[0].parameters())
    monkeypatch.setattr(fisher_run, "_load", lambda s, r: loaded)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fisher_run.run(spec)
    peak = torch.cuda.max_memory_allocated() - base
    per_param = (peak - (budget_mb + 64) * 2**20) / n
    print(f"{dtype}: peak {peak / 2**20:.0f} MiB above the weights for {n:,} parameters: "
          f"{per_param:.2f} bytes/param beyond the budget + 64 MiB")
    assert res.summary["split_half_jaccard"] is not None
    assert per_param <= 6.0


@pytest.mark.parametrize("device", DEVICES)
def test_bound_check_in_groups_on_device(device):
    """Issue 30: GRPO's bound check in groups of coordinates on the device, where an 8B model's
    sums fit only a group at a time: the same numbers as one group (the quantiles within their
    stated bracket), and on a GPU the device memory the sums take follows the largest group."""
    from compute.lm.verifiable_tasks import get_task
    from compute.studies import bound as B
    from tests.unit.fisher_tiny import ParityTask, char_tokenizer


    tok, task = char_tokenizer(), ParityTask(get_task("arithmetic-add?digits=1"))
    model = tiny_model("llama", hidden=64, seed=1).to(device)
    g = torch.Generator().manual_seed(2)
    indep = {n: (torch.rand(p.shape, generator=g) * 1e-3).to(device) for n, p in model.named_parameters()}
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    order = list(sizes)
    kw = dict(fisher=indep, prompts=3, group=4, max_new_tokens=5, seed=1)
    peaks = []
    for groups in (None, [[(n, 0, sizes[n])] for n in order]):  # one group; one per parameter
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        out = B.bound_check(model, tok, task, groups=groups, **kw)[0]
        if device == "cuda":
            peaks.append(torch.cuda.max_memory_allocated() - base)
        if groups is None:
            whole = out
    assert out["bound_groups"] == len(order) and whole["bound_groups"] == 1
    assert out["bound_violations"] == whole["bound_violations"] and out["bound_coordinates"] == whole["bound_coordinates"]
    assert out["bound_max_ratio"] == pytest.approx(whole["bound_max_ratio"], rel=1e-9)
    err = out["bound_ratio_quantile_rel_error"]
    for q, exact in whole["bound_ratio_quantiles"].items():
        assert abs(out["bound_ratio_quantiles"][q] - exact) <= err * exact * (1 + 1e-9), q
    if peaks:
        n, largest = sum(sizes.values()), max(sizes.values())
        print(f"device peak: one group {peaks[0] / 2**20:.1f} MiB, per parameter {peaks[1] / 2**20:.1f} MiB "
              f"({n:,} coordinates, largest {largest:,})")
        assert peaks[1] < peaks[0] - 8 * (n - 2 * largest)  # the sums of all but the largest group gone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_workers_row_offers_its_cuda_device_and_the_hosts_ram(tmp_path, monkeypatch):
    """compute/worker/device.py on a GPU machine (the CPU branch is tests/unit/test_worker_devices.py):
    a worker on `auto` writes cuda:N with the device's name and total memory, free memory within
    what CUDA reports free and within its MAX_JOB_MEMORY_MB, and the host's RAM beside it; the web
    then checks a job on `auto` against the GPU figure and a `cpu` job against the host's."""
    from app import ceiling, limits
    from compute.contract.settings import Settings
    from compute.worker import device
    from storage.db import upgrade

    upgrade(f"sqlite:///{tmp_path / 'fisherlens.db'}")
    monkeypatch.setenv("MAX_JOB_MEMORY_MB", "4096")
    capped = Settings(fisherlens_home=tmp_path, database_url=None, redis_url=None)
    row = device.profile(capped)
    index = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    assert row["device"] == f"cuda:{index}"
    assert row["device_name"] == torch.cuda.get_device_properties(index).name
    assert row["total_bytes"] == total
    assert 0 < row["free_bytes"] <= min(free, 4096 * 2**20)
    assert row["host_free_bytes"] is not None and row["host_free_bytes"] > 0

    monkeypatch.delenv("MAX_JOB_MEMORY_MB")
    settings = Settings(fisherlens_home=tmp_path, database_url=None, redis_url=None)
    device.publish(settings, "gpu@test")
    ceiling._workers_cache.clear()
    got, where = limits.free_memory(settings, "auto")
    assert where == f"cuda:{index} of worker gpu@test" and 0 < got <= free
    got_cpu, where_cpu = limits.free_memory(settings, "cpu")
    assert where_cpu == "cpu of worker gpu@test" and got_cpu > 0
    device.remove(settings, "gpu@test")
