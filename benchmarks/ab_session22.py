"""Session 22's two engine changes, each switched off and on in one process, alternating (issue 30):

- spans: the per-row products over each row's span of non-zero gradient positions
  (compute.fisher.persample.positions) against all positions, for `sequence` on bench_fisher.py's
  rows (Qwen3-20M 8x2x12, SmolLM2-135M 4x2x8), each against the floor of the same round; free
  memory handed back before every call, one thread; and the two results' largest difference;
- trims: the split-half Jaccard's loops handing freed memory back every TRIM_EVERY slices
  (compute.fisher.statistics) against never, on 100M synthetic values (bench_stat_ops.py's
  halves), two threads: the phase's time and its Jaccard.

    python benchmarks/ab_session22.py [--rounds 9]   # writes benchmarks/results/ab_session22.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def spans_ab(model_shape: str, rounds: int) -> dict:
    import bench_fisher as bf
    import torch

    from compute.fisher import persample as ps
    from compute.lm.sampling import sample_completions
    from compute.runtime.memory import release_freed_memory

    torch.set_num_threads(1)
    name, shape = model_shape.split(":")
    n_prompts, n_samples, new_tokens = (int(v) for v in shape.split("x"))
    model, tok, prompts = bf.load(name, torch.device("cpu"), torch.float32)
    roll = sample_completions(model, tok, prompts[:n_prompts], n_samples, new_tokens, seed=0)
    data = {"rows": (roll.input_ids, roll.attention_mask, roll.completion_mask)}
    real = ps.positions

    def off(g: torch.Tensor) -> tuple:
        return real(g)[0], None

    ps.positions = off
    without = bf.m_sequence(model, data)
    ps.positions = real
    with_spans = bf.m_sequence(model, data)
    diff = max(float((with_spans[k] - without[k]).abs().max() / (without[k].abs().max() + 1e-30)) for k in without)
    times: dict[str, list[float]] = {"floor": [], "spans": [], "all positions": []}
    for r in range(rounds):
        order = ["floor", "spans", "all positions"] if r % 2 else ["all positions", "spans", "floor"]
        for case in order:
            release_freed_memory()
            ps.positions = off if case == "all positions" else real
            t = time.perf_counter()
            bf.m_floor(model, data) if case == "floor" else bf.m_sequence(model, data)
            times[case].append(time.perf_counter() - t)
    ps.positions = real
    ratio = {k: round(statistics.median([a / b for a, b in zip(times[k], times["floor"], strict=True)]), 3)
             for k in ("spans", "all positions")}
    return {"model": model_shape, "seconds_median": {k: round(statistics.median(v), 4) for k, v in times.items()},
            "sequence_over_floor_median_of_rounds": ratio, "max_relative_difference": diff}


def trims_ab(rounds: int, numel: int = 100_000_000) -> dict:
    import torch

    from compute.fisher import statistics as S
    from compute.fisher.accumulate import HalfSums
    from compute.jobs.fisher_run import topk_jaccard_of_halves

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    total, diff = {}, {}
    for i in range(20):
        total[f"model.layers.{i}.mlp.up_proj.weight"] = (torch.randn(numel // 20, generator=g) * 2).exp() * 1e-6
        diff[f"model.layers.{i}.mlp.up_proj.weight"] = ((torch.rand(numel // 20, generator=g) * 2 - 1)
                                                        * 20000).round().to(torch.int16)
    halves = HalfSums(total, diff, 1)
    every = S.TRIM_EVERY
    times: dict[str, list[float]] = {"trims": [], "none": []}
    jaccard = {}
    for r in range(rounds):
        for case in (["trims", "none"] if r % 2 else ["none", "trims"]):
            S.TRIM_EVERY = every if case == "trims" else 1 << 62
            t = time.perf_counter()
            jaccard[case] = topk_jaccard_of_halves(halves, 1.0)
            times[case].append(time.perf_counter() - t)
    S.TRIM_EVERY = every
    return {"values": numel, "trim_every": every, "seconds_median": {k: round(statistics.median(v), 3)
                                                                      for k, v in times.items()},
            "jaccard": jaccard}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ab_session22.json"))
    a = ap.parse_args(argv)
    import torch

    out = {"command": "python benchmarks/ab_session22.py" + (f" --rounds {a.rounds}" if a.rounds != 9 else ""),
           "spans": [spans_ab(m, a.rounds) for m in ("qwen3-20m:8x2x12", "smollm2-135m:4x2x8")],
           "trims": trims_ab(6),
           "torch": torch.__version__, "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
