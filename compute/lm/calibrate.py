"""Calibrate the cost model on this machine: how long one token-pass takes, as a function of the
model's size, measured (issue 27: estimates from the clock, not a constant).

A token-pass (compute/contract/cost.py) is one token through one forward pass. Its time is a
fixed part (Python, kernel launches: what a tiny model's time is made of) plus a part that grows
with the parameters (the arithmetic: what a large model's time is made of):

    seconds = token_passes x (a + b x params)

A single constant "parameter-token-passes per second" (the earlier model) gets one end right and
the other wrong by one to two orders of magnitude: a zoo model of 108,800 parameters is all
overhead, SmolLM2-135M all arithmetic. `calibrate()` times forward + backward passes of two
random-init Llama models (about 0.1M and 12M parameters) on the device the jobs run on and solves
for a and b. `fisherlens calibrate` writes the result to FISHERLENS_HOME/throughput.json, which
app/ceiling.py reads; `fisherlens up` runs it in the background when the file is missing.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

# (hidden, layers, intermediate, vocab): a size where overhead dominates, one where arithmetic does
SHAPES = ((32, 2, 64, 128), (384, 6, 1024, 8192))
BATCH, LENGTH = 8, 48


def _model(hidden: int, layers: int, inter: int, vocab: int, device: Any, dtype: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=LENGTH * 2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.to(device)
    model.to(dtype)
    return model


def seconds_per_token_pass(model: Any, vocab: int, device: Any, repeats: int = 2) -> float:
    """Median seconds of one forward + backward over BATCH x LENGTH tokens, per token-pass (a
    backward counts as two forward passes, as in compute/contract/cost.py)."""
    import torch

    ids = torch.randint(0, vocab, (BATCH, LENGTH), device=device)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out = model(input_ids=ids).logits.float()
        out.logsumexp(-1).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is warm-up
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    times.sort()
    return times[len(times) // 2] / (3 * BATCH * LENGTH)


def calibrate(device: str = "auto", dtype: str = "float32") -> dict[str, Any]:
    """{"seconds_per_token_pass" a, "seconds_per_param_token_pass" b, the two measurements, the
    device, dtype and versions}: seconds = token_passes x (a + b x params)."""
    import torch

    from compute.lm.device import resolve_device

    dev = resolve_device(device)
    dt = getattr(torch, dtype)
    points = []
    for hidden, layers, inter, vocab in SHAPES:
        m = _model(hidden, layers, inter, vocab, dev, dt)
        n = sum(p.numel() for p in m.parameters())
        points.append({"params": n, "seconds_per_token_pass": seconds_per_token_pass(m, vocab, dev)})
        del m
    (p0, s0), (p1, s1) = ((p["params"], p["seconds_per_token_pass"]) for p in points)
    b = max((s1 - s0) / (p1 - p0), 1e-18)
    a = max(s0 - b * p0, 0.0)
    return {
        "model": "seconds = token_passes x (a + b x params)",
        "seconds_per_token_pass": a, "seconds_per_param_token_pass": b,
        "param_token_passes_per_s": 1.0 / b,  # the arithmetic part alone (the earlier unit)
        "points": points, "device": str(dev), "dtype": dtype, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write(path: Path, result: dict[str, Any]) -> Path:
    """Write atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)
    return path
