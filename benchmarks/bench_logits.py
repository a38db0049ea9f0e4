"""The training objectives' token log-probs: the whole logits vs the head a chunk at a time
(compute.lm.head), side by side in fresh processes (issue 30 item 4: activations at scale).

    python benchmarks/bench_logits.py [--rows 8] [--lengths 64,256,512] [--repeats 2]
        [--out benchmarks/results/bench_logits.json]

A random-init Llama of bench_scale.py's 20m shape (49,152-token vocab, SmolLM2's, tied head), float32,
CPU. Each case is one fresh process: token_logprobs over `rows` x `length` real tokens, then the
backward of their sum (an SFT step's loss and gradients), timed over `--repeats` calls after one
warm-up; peak = the RSS high-water mark above the process before the first call
(benchmarks/peakmem.py). `full`: the model's whole logits (return_logits=True, the path every model
took before); `chunked`: the default (compute.lm.head, LOGITS_CHUNK_BYTES of logits at a time,
recomputed in backward). Reported: MiB above the weights, seconds per call, and the
chunked/full ratios; the gradients of both are checked equal (float tolerance) in
tests/unit/test_sampling.py, not here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_scale import CHILD_PRELUDE, SHAPES  # noqa: E402

CHILD = CHILD_PRELUDE + r"""
from compute.lm.sampling import token_logprobs
from compute.runtime.memory import fixed_mmap_threshold, release_freed_memory
rows, length, repeats = (int(os.environ[k]) for k in ("ROWS", "LENGTH", "REPEATS"))
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=49152, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                  num_attention_heads=A, num_key_value_heads=KV, tie_word_embeddings=True,
                  max_position_embeddings=max(512, length))
model = LlamaForCausalLM(cfg).train()
ids = torch.randint(2, 49152, (rows, length))
am = torch.ones_like(ids)
full = os.environ["PATH_KIND"] == "full"
if os.environ["PATH_KIND"] == "checkpointed":  # what train's --gradient-checkpointing turns on
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
fixed_mmap_threshold()  # the train job's allocator setting (compute/runtime/memory.py)

def step():
    out = token_logprobs(model, ids, am, return_logits=full)
    lp = out[0] if full else out
    del out
    lp.sum().backward()
    model.zero_grad(set_to_none=True)

release_freed_memory()
peak = rss_peak_of(step)
t = time.perf_counter()
for _ in range(repeats):
    step()
sec = (time.perf_counter() - t) / repeats
print(json.dumps({"peak_mib": peak, "seconds": sec}))
"""


def predicted_mib(shape: tuple, tokens: int, checkpointed: bool) -> float:
    """The train estimate's activations for these tokens (compute.contract.cost: TRAIN_ACTIVATION_SHARE
    x Sizing.activation_bytes with one chunk of logits) plus the dense run's gradients (4 bytes/param)."""
    from compute.contract.cost import TRAIN_ACTIVATION_SHARE, Sizing, logits_chunk_tokens

    h, layers, inter, heads, kv = shape
    params = 49152 * h + layers * (2 * h * h + 2 * h * (h // heads * kv) + 3 * h * inter)  # norms: 0.01%
    z = Sizing(params=params, layers=layers, hidden=h, vocab=49152, intermediate=inter)
    act = z.activation_bytes(tokens, logit_tokens=logits_chunk_tokens(49152), checkpointed=checkpointed)
    return (TRAIN_ACTIVATION_SHARE * act + 4.0 * params) / 2**20


def run(kind: str, shape: tuple, rows: int, length: int, repeats: int, threads: int) -> dict:
    env = {**os.environ, "ROOT": str(ROOT), "SHAPE": json.dumps(shape), "ROWS": str(rows),
           "LENGTH": str(length), "REPEATS": str(repeats), "PATH_KIND": kind, "THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--lengths", default="64,256,512")
    ap.add_argument("--size", default="20m")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpointing", action="store_true",
                    help="a third case: the chunked head with gradient checkpointing on (train's flag)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_logits.json"))
    args = ap.parse_args(argv)
    from compute.contract.cost import LOGITS_CHUNK_BYTES

    shape = SHAPES[args.size]
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        full = run("full", shape, args.rows, length, args.repeats, args.threads)
        chunked = run("chunked", shape, args.rows, length, args.repeats, args.threads)
        tokens = args.rows * length
        row = {"size": args.size, "rows": args.rows, "length": length, "tokens": tokens,
               "full_logits_mib": tokens * 49152 * 4 / 2**20,
               "full": full, "chunked": chunked,
               "peak_ratio": chunked["peak_mib"] / full["peak_mib"],
               "time_ratio": chunked["seconds"] / full["seconds"]}
        chunked["predicted_mib"] = predicted_mib(shape, tokens, False)
        if args.checkpointing:
            ckpt = run("checkpointed", shape, args.rows, length, args.repeats, args.threads)
            ckpt["predicted_mib"] = predicted_mib(shape, tokens, True)
            row |= {"checkpointed": ckpt, "checkpointed_peak_ratio": ckpt["peak_mib"] / chunked["peak_mib"],
                    "checkpointed_time_ratio": ckpt["seconds"] / chunked["seconds"]}
        rows.append(row)
        print(f"{args.size} {args.rows}x{length}: peak {full['peak_mib']:.0f} -> {chunked['peak_mib']:.0f} MiB "
              f"({row['peak_ratio']:.2f}x; predicted {chunked['predicted_mib']:.0f}), {full['seconds']:.2f} -> "
              f"{chunked['seconds']:.2f} s ({row['time_ratio']:.2f}x)"
              + (f"; checkpointed {row['checkpointed']['peak_mib']:.0f} MiB (predicted "
                 f"{row['checkpointed']['predicted_mib']:.0f}), {row['checkpointed']['seconds']:.2f} s"
                 if args.checkpointing else ""))
    res = {"rows": rows, "logits_chunk_bytes": LOGITS_CHUNK_BYTES,
           "settings": f"token_logprobs + backward of the sum, Llama {args.size} shape, vocab 49152, tied, "
                       f"float32, CPU, {args.threads} threads, {args.repeats} timed calls after a warm-up, "
                       "each case a fresh process",
           "machine": f"{platform.machine()} {os.cpu_count()} cpus", "command": "python benchmarks/bench_logits.py "
           + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
