"""Where GRPO's bound check spends its time, against what the estimate says (issue 30: the
per-coordinate work, the fold into float64 sums and the summary, was counted nowhere).

    python benchmarks/bench_bound_time.py [--sizes 50m,100m] [--group-shares 0.25] [--out FILE]

Each size a random-init Llama of bench_scale.py's shapes (tied 49,152-token embedding), CPU, the
first GRPO batch of 2 prompts x 4 completions of 8 new tokens, in one group and in groups sized to
a share of its sums (compute.contract.cost.bound_plan). The machine's calibration is measured in
the same process; the estimate is compute.contract.cost.bound_seconds at it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50m,100m")
    ap.add_argument("--group-shares", default="0.25")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_bound_time.json"))
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from bench_scale import SHAPES
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import compute.lm.sampling  # noqa: F401  (imported before the clock)
    import compute.train.objectives.grpo  # noqa: F401
    from compute.contract import cost as C
    from compute.contract.tasknames import prompt_tokens
    from compute.lm.calibrate import calibrate
    from compute.lm.verifiable_tasks import get_task
    from compute.studies import bound as B

    cal = calibrate("cpu")
    tok = AutoTokenizer.from_pretrained(str(ROOT / "compute" / "zoo_weights" / "arith-base"))
    task = get_task("arithmetic")
    parts = {"sampling": 0.0, "rows' backward and fold": 0.0, "summary pass": 0.0, "summary finish": 0.0}

    def timed(key: str, f):  # noqa: ANN001, ANN202
        def g(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                parts[key] += time.perf_counter() - t
        return g

    B._first_batch = timed("sampling", B._first_batch)
    B.accumulate_sample_grads = timed("rows' backward and fold", B.accumulate_sample_grads)
    B._Summary.add = timed("summary pass", B._Summary.add)
    B._Summary.finish = timed("summary finish", B._Summary.finish)
    rows_out = []
    t0 = time.time()
    for size in a.sizes.split(","):
        H, L, inter, heads, kv = SHAPES[size]
        cfg = LlamaConfig(vocab_size=49152, hidden_size=H, intermediate_size=inter, num_hidden_layers=L,
                          num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                          max_position_embeddings=512)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        n = sum(p.numel() for p in model.parameters())
        fisher = {k: torch.rand_like(p) for k, p in model.named_parameters()}
        names, sizes = [k for k, _ in model.named_parameters()], [p.numel() for p in model.parameters()]
        z = C.Sizing(params=n, layers=L, hidden=H, vocab=49152, intermediate=inter, a=cal["seconds_per_token_pass"],
                     b=cal["seconds_per_param_token_pass"],
                     prompt_tokens=prompt_tokens("arithmetic", C.COST_PROMPT_TOKENS))
        for share in [None] + [float(x) for x in a.group_shares.split(",") if x]:
            free = None if share is None else share * C.BOUND_BYTES_PER_PARAM * n + C.bound_fixed_bytes(n) + 4 * max(sizes)
            plan = C.bound_plan(sizes, free, 0.0, unit=B.SLICE)
            groups = [[(names[i], lo, hi) for i, lo, hi in g] for g in plan.groups]
            for k in parts:
                parts[k] = 0.0
            t = time.perf_counter()
            B.bound_check(model, tok, task, groups=groups, fisher=fisher, prompts=2, group=4, max_new_tokens=8)
            total = time.perf_counter() - t
            est = C.bound_seconds(z, 8, 8, len(groups))
            row = {"size": size, "n_params": n, "groups": len(groups), "seconds": round(total, 2),
                   "parts": {k: round(v, 2) for k, v in parts.items()}, "estimate_seconds": round(est, 2),
                   "estimate_over_measured": round(est / total, 2)}
            print(json.dumps(row), flush=True)
            rows_out.append(row)
        del model, fisher
    meta = {"command": "python benchmarks/bench_bound_time.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "threads": a.threads, "machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "calibration": {k: cal[k] for k in ("seconds_per_token_pass", "seconds_per_param_token_pass")},
            "prompt_tokens_counted": prompt_tokens("arithmetic", C.COST_PROMPT_TOKENS),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_seconds": round(time.time() - t0, 1)}
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
