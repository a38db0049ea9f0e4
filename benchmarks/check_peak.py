"""The engine's self-check alone: its peak memory above the loaded weights (issue 30).

    python benchmarks/check_peak.py MODEL_FOLDER [--out FILE]

Runs compute.fisher.estimators._verify (the once-per-model check that per-row gradients add up to
autograd's) on two random rows of 24 tokens, in this process, with the weights resident before
the mark, and samples the RSS every 5 ms (the method of benchmarks/peak_stacks.py). The check's
room is the accumulators' (6 bytes/param, not yet allocated when it runs) and a 256 MiB budget.
Prints MiB and bytes/param above the weights; --out writes them as JSON. Run it in a worktree of
another commit to compare (the script only calls _verify and _eval)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from peakmem import rss_mib  # noqa: E402 (after the path it lives on)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM

    from compute.fisher import estimators as E

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    for p in model.parameters():  # resident before the mark
        float(p.detach().sum())
    params = E.trainable_parameters(model)
    n = sum(p.numel() for p in params.values())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g)
    am, cm = torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool)
    base, peak, stop = rss_mib(), [0.0], [False]

    def watch() -> None:
        while not stop[0]:
            peak[0] = max(peak[0], rss_mib() - base)
            time.sleep(0.005)
    t = threading.Thread(target=watch)
    t.start()
    t0 = time.perf_counter()
    with E._eval(model):
        E._verify(model, params, (ids, am, cm, torch.ones(2), torch.zeros(2, dtype=torch.long)),
                  256 << 20, check_bytes=6 * n)
    seconds = time.perf_counter() - t0
    stop[0] = True
    t.join()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    out = {"commit": commit, "n_params": n, "peak_above_weights_mib": round(peak[0], 1),
           "bytes_per_param": peak[0] * 2**20 / n, "seconds": seconds}
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
