"""The Fisher job's memory, measured (issue 30): its peak above the loaded weights stays within a
fixed number of bytes per parameter plus its temporaries budget. Measured in a fresh process
(VmHWM reset after loading, benchmarks/peakmem.py), on a random-init Llama-shaped model large
enough (~7M parameters) that per-parameter costs dominate the fixed ones.

Before issue 30 the same job took ~55 bytes/param above the weights (full sorts with int64
indices, float64 copies, a second set of accumulators per prompt chunk, the check's squares)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUDGET_MB = 64
# Issue 30's bound: 6 bytes/param above the weights beyond the temporaries budget (the exact
# float32 total 4 + the int16 half difference 2; the statistics stream, the self-check runs in
# budget-sized groups); the fixed part covers sampling, activations and the allocator at this size.
# Measured at 7.3M parameters (budget 64 MiB), one run each: 449 MiB above the weights before
# issue 30 (41 bytes/param beyond budget + fixed), 210 MiB with two float32 half sums and a sorted
# copy (7.2: fails this bound), 165 MiB now (0.7). bfloat16 (budget 128 MiB): 217-249 MiB locally
# and once 275 on CI (7.3: failed) while glibc kept what the float32 check freed; 198-200 since the
# job hands freed memory back between phases and runs the check under a fixed mmap threshold.
BYTES_PER_PARAM = 6
FIXED_MB = 96

SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.environ["ROOT"])
sys.path.insert(0, os.path.join(os.environ["ROOT"], "benchmarks"))
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from peakmem import rss_peak_of
from compute.jobs.fisher import FisherSpec
from compute.jobs.fisher_run import run, _load
folder = os.environ["FOLDER"]
cfg = LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=256)
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(folder)
import shutil
for f in os.listdir(os.environ["TOK"]):
    if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
        shutil.copy(os.path.join(os.environ["TOK"], f), folder)
spec = FisherSpec(model=folder, prompts=4, samples=2, max_new_tokens=8,
                  memory_budget_mb=int(os.environ["BUDGET"]), dtype=os.environ["DTYPE"],
                  estimator=os.environ["ESTIMATOR"])
loaded = _load(spec, None)
n = sum(p.numel() for p in loaded[0].parameters())
from compute.jobs import fisher_run
fisher_run._load = lambda spec, refs: loaded  # the job's own work, weights already loaded
res = {}
res["peak_mb"] = rss_peak_of(lambda: res.setdefault("r", run(spec)))
res["n_params"] = n
largest = max(p.numel() for p in loaded[0].parameters())
print(json.dumps({"peak_mb": res["peak_mb"], "n_params": n, "largest": largest,
                  "precision_error": res["r"].summary.get("precision_error"),
                  "precision_error_skipped": res["r"].summary.get("precision_error_skipped")}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype, budget_mb, estimator", [
    ("float32", BUDGET_MB, "sequence"), ("bfloat16", 2 * BUDGET_MB, "sequence"),
    ("float32", BUDGET_MB, "token"), ("float32", BUDGET_MB, "batch")])
def test_fisher_job_peak_above_weights_is_bounded_per_parameter(tmp_path: Path, zoo_home: Path, dtype: str,
                                                                 budget_mb: int, estimator: str) -> None:
    """bfloat16: the float32 error check runs too (a budget with room for it: its sums and the
    widened weights, 10 bytes/param at this size, come out of the temporaries budget on a CPU,
    where the Fisher's own sums hold the 6 bytes/param); before it was planned within the job's
    allowance it loaded a float32 copy of the model and compared float64 copies of whole tensors
    (38 bytes/param above the weights at 50M, 31.8 beyond the budget on an H200)."""
    env = {**os.environ, "ROOT": str(ROOT), "FOLDER": str(tmp_path / "m"), "BUDGET": str(budget_mb),
           "TOK": str(zoo_home / "zoo" / "arith-base"), "ALLOWED_MODEL_ROOTS": str(tmp_path),
           "FISHERLENS_HOME": str(zoo_home), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DTYPE": dtype,
           "ESTIMATOR": estimator}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    # the batch estimator has no per-sample temporaries: the budget does not apply to it (its sum,
    # 4 bytes/param, and one gradient at a time). token and batch hold the bound here with the
    # code before session 13's changes too (batch 119 vs 122 MiB: at 7.3M the peak is in the
    # fixed part); what those changes moved is measured at 50M-100M, where the per-parameter part
    # is the peak: docs/scale.md, "Every estimator". Its one gradient at a time is its temporaries:
    # the largest tensor's (the tied 16,384-row embedding, 16 MiB here; CI once measured the batch
    # job 6.2 bytes/param beyond the fixed part with none allowed for it, under load, and 2.5-4.8
    # locally, the same before and after session 14's changes)
    temporaries = 4 * got["largest"] / 2**20 if estimator == "batch" else budget_mb
    per_param = (got["peak_mb"] - temporaries - FIXED_MB) * 2**20 / got["n_params"]
    assert got["n_params"] > 5_000_000
    print(f"{dtype} {estimator}: peak {got['peak_mb']:.0f} MiB above the weights for {got['n_params']:,} parameters: "
          f"{per_param:.1f} bytes/param beyond budget + fixed")
    if dtype == "bfloat16":  # the check ran, against the float32 checkpoint's own values
        err = got["precision_error"]
        assert err is not None, got["precision_error_skipped"]
        assert 0 < err["relative_l1"] < 0.2 and err["reference"].startswith("the checkpoint's float32 values")
    assert per_param <= BYTES_PER_PARAM, got
