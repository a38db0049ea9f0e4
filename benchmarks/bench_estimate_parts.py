"""The measurements behind the cost model's per-part constants that no job reports by itself
(session 19, compute/contract/cost.py), in one run, written to results/bench_estimate_parts.json:

- decode: a generation step's fixed part in calls (the calibration's unit) on zoo models of 2 and 8
  layers and SmolLM2-135M (30), at 8 and 64 rows: (generate time - its token-passes) / steps / call
  (DECODE_STEP_CALLS_PER_LAYER);
- stops: the decode steps a 10-step GRPO train of arith-base really takes per sampled batch, against
  max_new_tokens (why the estimate, counting every completion to max_new_tokens, is an upper bound);
- calibration: four calibrations back to back, their `a` (how much every call-counted part moves
  between runs on this machine).

    python benchmarks/bench_estimate_parts.py [--no-smollm2]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decode(models: list[str], cal: dict) -> list[dict]:
    import torch

    from compute.contract.cost import Sizing
    from compute.lm.causal_lm import load_model

    rows = []
    for name in models:
        m, _ = load_model(name, device=torch.device("cpu"), dtype="float32")
        m.eval()
        params = sum(p.numel() for p in m.parameters())
        z = Sizing(params=params, a=cal["seconds_per_token_pass"], b=cal["seconds_per_param_token_pass"])
        for n_rows, new, prompt in ((8, 16, 7), (64, 16, 7)):
            ids = torch.randint(3, 20, (n_rows, prompt))

            def gen(m: torch.nn.Module = m, ids: torch.Tensor = ids, new: int = new) -> None:
                with torch.no_grad():
                    m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=True, pad_token_id=0)
            gen()
            t = time.perf_counter()
            for _ in range(3):
                gen()
            g = (time.perf_counter() - t) / 3
            passes = z.passes_s(n_rows * (prompt + new))
            rows.append({"model": name, "layers": m.config.num_hidden_layers, "params": params, "rows": n_rows,
                         "new_tokens": new, "generate_s": g, "passes_s": passes,
                         "decode_step_calls": (g - passes) / new / z.calls_s(1)})
            print(rows[-1], flush=True)
    return rows


def stops() -> dict:
    import compute.lm.sampling as S
    from compute.jobs.registry import parse_spec
    from compute.jobs.runners import get_runner

    seen: collections.Counter = collections.Counter()
    orig = S.generate_tokens

    def counted(model, prompt_ids, max_new_tokens, pick, eos_id, pad_id, fault=None):  # type: ignore[no-untyped-def]
        out = orig(model, prompt_ids, max_new_tokens, pick, eos_id, pad_id, fault)
        seen[(max_new_tokens, max((len(r) for r in out), default=0))] += 1
        return out

    S.generate_tokens = counted
    try:
        spec = parse_spec("train", {"model": "arith-base", "steps": 10, "bound": False, "concentration": False})
        get_runner("train")(spec, lambda f, m="": None, refs=None)
    finally:
        S.generate_tokens = orig
    return {"spec": "train arith-base, 10 GRPO steps, bound and concentration off",
            "batches": [{"max_new_tokens": k[0], "decode_steps": k[1], "batches": v} for k, v in sorted(seen.items())]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-smollm2", action="store_true")
    args = ap.parse_args()
    from compute.lm import calibrate

    cals = []
    for _ in range(4):
        c = calibrate.calibrate(device="cpu")
        cals.append({"a": c["seconds_per_token_pass"], "b": c["seconds_per_param_token_pass"]})
        print(cals[-1], flush=True)
    models = ["arith-base", "arith-deep-base"] + ([] if args.no_smollm2 else ["smollm2-135m"])
    out = {"benchmark": "bench_estimate_parts", "command": " ".join(["python", *sys.argv]),
           "load_average": os.getloadavg(), "calibrations": cals,
           "decode": decode(models, c), "stops": stops()}
    path = ROOT / "benchmarks" / "results" / "bench_estimate_parts.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
