"""Where the `sequence` estimator's time goes against its floor (issue 30: <= 1.2x one batched
forward+backward), on one thread, on bench_fisher.py's rows (Qwen3-20M: 8 prompts x 2 samples, 12 new
tokens; SmolLM2-135M: 4 x 2, 8): the floor's forward and backward, the estimator's whole pass, and inside it the
per-row square sums of the linear weights (compute.fisher.persample.linear_square_sum), each the
median of interleaved rounds. What is left of the pass beyond the floor's forward, the floor's
backward less its weight-gradient products, and the square sums is the hooks' and the
accumulator's own work.

    python benchmarks/profile_sequence.py [--model qwen3-20m:8x2x12] [--rounds 7]
        # adds the model's row to benchmarks/results/profile_sequence.json
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default="qwen3-20m:8x2x12",
                    help="NAME:PROMPTSxSAMPLESxNEW_TOKENS (bench_fisher.py's names), e.g. smollm2-135m:4x2x8")
    ap.add_argument("--allocator", choices=["warm", "default"], default="warm",
                    help="warm: glibc keeps freed memory (no case pays first-touch faults); default: "
                    "glibc as a job runs it (blocks of 32 MiB or more mapped and unmapped per call)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "profile_sequence.json"))
    a = ap.parse_args(argv)
    import resource

    import torch

    torch.set_num_threads(1)
    # a warm allocator for every case: glibc keeps what a call freed in the heap (no mmap, no
    # trim), so no case pays the first-touch page faults of memory the one before returned to the
    # system. Without it the floor's gradients were fresh pages in some rounds and not in others
    # (32,000 minor faults, 0.13 s of a 0.4 s floor), and the ratio moved 1.2-1.5x with the order.
    from compute.runtime.memory import M_TRIM_THRESHOLD, _glibc

    libc = _glibc() if a.allocator == "warm" else None
    if libc is not None:
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no block gets its own mapping (glibc caps the threshold at 32 MiB)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    import bench_fisher as bf

    from compute.fisher import persample as ps
    from compute.lm.sampling import sample_completions

    name, shape = a.model.split(":")
    n_prompts, n_samples, new_tokens = (int(v) for v in shape.split("x"))
    model, tok, prompts = bf.load(name, torch.device("cpu"), torch.float32)
    roll = sample_completions(model, tok, prompts[:n_prompts], n_samples, new_tokens, seed=0)
    ids, am, cm = roll.input_ids, roll.attention_mask, roll.completion_mask
    data = {"rows": (ids, am, cm)}
    square = [0.0]
    real = ps.linear_square_sum

    def timed_square(*args, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = real(*args, **kw)
        square[0] += time.perf_counter() - t
        return out

    ps.linear_square_sum = timed_square
    # the floor's weight-gradient products: each linear weight's batched G^T X, as autograd makes it
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs: dict[int, torch.Tensor] = {}
    grads: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, i, o: inputs.__setitem__(id(mod), i[0].detach())) for m in linears]
    hooks += [m.register_full_backward_hook(lambda mod, gi, go: grads.__setitem__(id(mod), go[0].detach()))
              for m in linears]
    model.zero_grad(set_to_none=True)
    bf._loss(model, ids, am, cm).backward()
    for h in hooks:
        h.remove()
    pairs = [(grads[id(m)].reshape(-1, m.out_features), inputs[id(m)].reshape(-1, m.in_features))
             for m in linears if id(m) in grads]

    def floor_forward() -> None:
        model.zero_grad(set_to_none=True)
        bf._loss(model, ids, am, cm)

    def floor() -> None:
        bf.m_floor(model, data)

    kept: dict[torch.nn.Parameter, torch.Tensor] = {}

    def floor_kept() -> None:  # accumulated into its own gradients of the call before: no fresh memory
        for p in model.parameters():
            if p in kept:
                p.grad = kept[p].zero_()
        bf._loss(model, ids, am, cm).backward()
        kept.update({p: p.grad for p in model.parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)

    def weight_products() -> None:
        for g, x in pairs:
            g.T @ x

    def sequence() -> None:
        bf.m_sequence(model, data)

    cases = {"floor": floor, "floor, gradients kept": floor_kept, "floor forward": floor_forward,
             "floor weight-gradient products": weight_products, "sequence": sequence}
    for f in cases.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in cases}
    faults: dict[str, list[int]] = {k: [] for k in cases}
    squares: list[float] = []
    for _ in range(a.rounds):
        for case, f in cases.items():
            square[0] = 0.0
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            f()
            times[case].append(time.perf_counter() - t)
            faults[case].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            if case == "sequence":
                squares.append(square[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    med["sequence: linear square sums"] = statistics.median(squares)
    backward = med["floor, gradients kept"] - med["floor forward"]
    rest = med["sequence"] - med["floor forward"] - (backward - med["floor weight-gradient products"]) \
        - med["sequence: linear square sums"]
    out = {
        "what": "seconds, median of interleaved rounds, one thread",
        "command": "python benchmarks/profile_sequence.py --model " + a.model
                   + (f" --rounds {a.rounds}" if a.rounds != 7 else "")
                   + (" --allocator default" if a.allocator == "default" else ""),
        "model": f"{name} (bench_fisher.py), {n_prompts} prompts x {n_samples} samples, {new_tokens} new tokens",
        "rows": int(ids.shape[0]), "length": int(ids.shape[1]),
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "minor_page_faults_median": {k: statistics.median(v) for k, v in faults.items()},
        "allocator": "glibc: no mmap blocks, trim threshold 1 GiB (no case pays first-touch faults)"
                     if a.allocator == "warm" else "glibc's defaults, as a job runs (the estimator trims after its pass)",
        "sequence_over_floor": round(med["sequence"] / med["floor"], 3),
        "sequence_over_floor_gradients_kept": round(med["sequence"] / med["floor, gradients kept"], 3),
        "square_sums_over_weight_products": round(med["sequence: linear square sums"]
                                                  / med["floor weight-gradient products"], 3),
        "hooks_and_accumulator_s": round(rest, 4),
        # the pass were its square sums as fast as the floor's batched products
        "sequence_over_floor_at_product_speed": round(
            (med["sequence"] - med["sequence: linear square sums"] + med["floor weight-gradient products"])
            / med["floor, gradients kept"], 3),
        "torch": torch.__version__, "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    path = Path(a.out)
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs = runs if "runs" in runs else {"runs": {}}
    runs["runs"][a.model + (" --allocator default" if a.allocator == "default" else "")] = out
    path.write_text(json.dumps(runs, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
