"""A run folder as a series: the time of one checkpoint's point against the time to read its
tensors and the previous checkpoint's (compute.sparsity.series, SVD off: it has none).

What is measured, in one process, on one synthetic run folder per stored dtype:
- a Qwen3-shaped model (embed, per layer q/k/v/o/gate/up/down + 2 norms, final norm, untied
  lm_head; default 8 layers, hidden 384, intermediate 1152, vocab 8192: 19.9M parameters) saved as
  the base and as `--checkpoints` checkpoint-N folders (model.safetensors + config.json), each
  step moving a random 30% of the coordinates by ~1e-4 (Adam-like), then stored in the dtype, so
  bf16 rounding leaves many of them unchanged as in a real bf16 run;
- `read`: for checkpoint k, every tensor of checkpoint k and of checkpoint k-1 (the base for the
  first) read with safetensors `safe_open(...).get_tensor(name).clone()`: the bytes brought into
  process memory (get_tensor alone maps the file lazily and touches nothing);
- `point`: compute.sparsity.series's time for checkpoint k (the `seconds` of its point). The
  series goes name by name through every checkpoint, so each tensor is read once: a point's
  seconds are reading checkpoint k's tensors, both pairs (vs the base, vs the previous one, held
  from the step before), both conventions, the sync bytes, its groups, plus 1/K of reading the
  base. Without a Fisher, and with a Fisher (top-1% support, AUC) as a second number (the
  Fisher's one-time plan, its top-k and ranks, is not in any point; see `series`);
- `ratio` = point / read of the same checkpoint in the same round;
- `series`: the whole checkpoint_series call (opening, plan, every point) / the sum of the
  round's reads: the end-to-end ratio, with and without the Fisher;
- `kernel`: whether compute.sparsity.series_kernel's C loop ran (`--no-kernel`: the numpy sweep). Rounds alternate read and
  series so load spikes on a shared machine hit both; the table gives the median and the worst
  ratio over rounds and checkpoints. The goal (issue 19): point <= 3x read, with SVD off.
- `--cold`: before each read and each series run, the files are dropped from the page cache
  (posix_fadvise DONTNEED), so both read from the disk: the case of a run folder larger than RAM;
- peak memory: the RSS high-water mark (ru_maxrss) of a fresh child process running the series,
  minus that of a child that only imports and opens the folders: evidence that the series streams
  (compare with one checkpoint's size).

    .venv/bin/python benchmarks/bench_series.py                          # bf16 and fp32, 3 rounds
    .venv/bin/python benchmarks/bench_series.py --rounds 1 --checkpoints 2 --no-save
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def shapes(layers: int, hidden: int, inter: int, vocab: int) -> dict[str, tuple[int, ...]]:
    head = 64
    kv = hidden // 2
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                       "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "self_attn.q_norm.weight": (head,), p + "self_attn.k_norm.weight": (head,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
    return out


def make_run(root: Path, dtype: str, sh: dict[str, tuple[int, ...]], checkpoints: int) -> tuple[Path, Path]:
    """root/base and root/run/checkpoint-1..N, one tensor at a time (float32 master in memory
    for one tensor only: each checkpoint's tensor is regenerated from a per-(name, step) seed)."""
    import torch
    from safetensors.torch import save_file

    dt = getattr(torch, dtype)
    base, run = root / "base", root / "run"
    folders = [base] + [run / f"checkpoint-{k}" for k in range(1, checkpoints + 1)]
    for f in folders:
        f.mkdir(parents=True)
        (f / "config.json").write_text("{}")
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in folders]
    for j, (name, s) in enumerate(sh.items()):
        g = torch.Generator().manual_seed(j)
        w = torch.randn(s, generator=g) * 0.02 if len(s) > 1 else torch.ones(s)
        for k in range(len(folders)):
            if k:
                moved = torch.rand(s, generator=g) < 0.3
                w = w + moved * torch.randn(s, generator=g) * 1e-4
            tensors[k][name] = w.to(dt).contiguous()
    for k, f in enumerate(folders):
        save_file(tensors[k], str(f / "model.safetensors"))
    return base, run


def drop_cache(folders: list[Path]) -> None:
    for f in folders:
        for p in f.glob("*.safetensors"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_time(a: Path, b: Path) -> float:
    """Seconds to read every tensor of both folders into memory (get_tensor + clone)."""
    from safetensors import safe_open

    t0 = time.perf_counter()
    for f in (a, b):
        with safe_open(str(f / "model.safetensors"), framework="pt") as h:
            for n in h.keys():  # noqa: SIM118
                t = h.get_tensor(n).clone()
                del t
    return time.perf_counter() - t0


def _child_series(base: str, run: str, fisher: str | None, q: Any) -> None:
    import resource

    from compute.sparsity.diff import Checkpoint
    from compute.sparsity.series import LazyTensors, checkpoint_series, open_run

    Checkpoint(base)
    open_run(run)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    checkpoint_series(base, run, fisher=LazyTensors(fisher) if fisher else None)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    q.put((before, after))


def peak_extra_mb(base: Path, run: Path, fisher: Path | None) -> tuple[float, float]:
    """(RSS high-water before the series, increase during it) in MB, in a fresh child process."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_series, args=(str(base), str(run), str(fisher) if fisher else None, q))
    p.start()
    before, after = q.get(timeout=3600)
    p.join()
    return before / 1024, (after - before) / 1024


def bench_dtype(dtype: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    from compute.sparsity.series import LazyTensors, checkpoint_series

    sh = shapes(args.layers, args.hidden, args.inter, args.vocab)
    n_params = sum(math.prod(s) for s in sh.values())
    root = tmp / dtype
    base, run = make_run(root, dtype, sh, args.checkpoints)
    fisher_path = root / "fisher.safetensors"
    g = torch.Generator().manual_seed(99)
    save_file({n: torch.rand(s, generator=g) ** 4 for n, s in sh.items()}, str(fisher_path))
    os.sync()  # the run folder on disk, as a finished training run's (no write-back during the timings)
    folders = [base] + sorted((run.glob("checkpoint-*")), key=lambda p: int(p.name.split("-")[1]))
    rows: list[dict[str, Any]] = []
    wholes: list[dict[str, Any]] = []
    for r in range(args.rounds):
        reads = []
        for k in range(1, len(folders)):
            if args.cold:
                drop_cache(folders)
            reads.append(read_time(folders[k], folders[k - 1]))
        if args.cold:
            drop_cache(folders + [root])
        t0 = time.perf_counter()
        res = checkpoint_series(base, run)
        whole = time.perf_counter() - t0
        if args.cold:
            drop_cache(folders + [root])
        t0 = time.perf_counter()
        res_f = checkpoint_series(base, run, fisher=LazyTensors(fisher_path))
        whole_f = time.perf_counter() - t0
        wholes.append({"round": r, "reads_s": sum(reads), "series_s": whole, "series_fisher_s": whole_f,
                       "ratio_series": whole / sum(reads), "ratio_series_fisher": whole_f / sum(reads)})
        for k in range(1, len(folders)):
            point, point_f = res.points[k - 1]["seconds"], res_f.points[k - 1]["seconds"]
            rows.append({"round": r, "step": k, "read_s": reads[k - 1], "point_s": point,
                         "point_fisher_s": point_f, "ratio": point / reads[k - 1],
                         "ratio_fisher": point_f / reads[k - 1]})
        print(f"{dtype} round {r}: " + ", ".join(f"ck{x['step']} read {x['read_s']:.3f}s point {x['point_s']:.3f}s "
                                                 f"({x['ratio']:.2f}x; with Fisher {x['ratio_fisher']:.2f}x)"
                                                 for x in rows if x["round"] == r), flush=True)
    rss_before, rss_extra = peak_extra_mb(base, run, None)
    _, rss_extra_f = peak_extra_mb(base, run, fisher_path)
    size_mb = (base / "model.safetensors").stat().st_size / 2**20
    largest = max(math.prod(s) for s in sh.values())
    g0 = res.points[-1]
    out = {
        "dtype": dtype, "n_params": n_params, "checkpoint_mb": round(size_mb, 1),
        "largest_tensor_numel": largest, "checkpoints": args.checkpoints, "rounds": args.rounds,
        "rows": rows, "series_rounds": wholes,
        "ratio_series_median": statistics.median(x["ratio_series"] for x in wholes),
        "ratio_series_fisher_median": statistics.median(x["ratio_series_fisher"] for x in wholes),
        "ratio_median": statistics.median(x["ratio"] for x in rows),
        "ratio_max": max(x["ratio"] for x in rows),
        "ratio_fisher_median": statistics.median(x["ratio_fisher"] for x in rows),
        "ratio_fisher_max": max(x["ratio_fisher"] for x in rows),
        "read_s_median": statistics.median(x["read_s"] for x in rows),
        "point_s_median": statistics.median(x["point_s"] for x in rows),
        "point_fisher_s_median": statistics.median(x["point_fisher_s"] for x in rows),
        "rss_mb_before_series": round(rss_before, 1),
        "rss_mb_extra_series": round(rss_extra, 1),
        "rss_mb_extra_series_fisher": round(rss_extra_f, 1),
        "last_point_step_sparsity": g0["vs_prev"]["global"]["all"]["update_sparsity"],
        "last_point_base_sparsity": g0["vs_base"]["global"]["all"]["update_sparsity"],
    }
    shutil.rmtree(root, ignore_errors=True)
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(data: dict[str, Any]) -> str:
    lines = [
        f"Source: `benchmarks/results/bench_series.json` (`{data['command']}`, commit {data['commit']}, "
        f"{data['date']}, torch {data['torch']}, threads {data['threads']}, page cache: "
        f"{'cold (dropped before each read and series)' if data['cold'] else 'warm'}, "
        f"{'C kernel' if data['kernel'] else 'numpy sweep'}, load average at the "
        f"end {data['loadavg']}). Ratio: a checkpoint's series time / the time to read its tensors and "
        f"the previous checkpoint's, same round; median and worst over {data['results'][0]['rounds']} rounds x "
        f"{data['results'][0]['checkpoints']} checkpoints.",
        "",
        "| stored dtype | params | checkpoint MB | read s (median) | point s (median) | ratio median | ratio worst "
        "| with Fisher: ratio median | worst | whole series / reads (with Fisher, plan included) "
        "| series peak RSS +MB (with Fisher) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["results"]:
        lines.append(
            f"| {r['dtype']} | {r['n_params'] / 1e6:.1f}M | {r['checkpoint_mb']} | {r['read_s_median']:.3f} | "
            f"{r['point_s_median']:.3f} | {r['ratio_median']:.2f} | {r['ratio_max']:.2f} | "
            f"{r['ratio_fisher_median']:.2f} | {r['ratio_fisher_max']:.2f} | {r['ratio_series_median']:.2f} "
            f"({r['ratio_series_fisher_median']:.2f}) | {r['rss_mb_extra_series']} "
            f"({r['rss_mb_extra_series_fisher']}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--inter", type=int, default=1152)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the files from the page cache before each timing")
    ap.add_argument("--out", default=str(RESULTS / "bench_series.json"))
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--no-kernel", action="store_true", help="the numpy sweep instead of the C kernel")
    args = ap.parse_args()
    if args.no_kernel:
        os.environ["FISHERLENS_SERIES_KERNEL"] = "0"  # children (peak RSS) inherit it
    import torch

    from compute.sparsity import series_kernel

    torch.set_num_threads(args.threads)
    series_kernel.kernel()  # built once per machine (cached): not inside the first timed point
    tmp = Path(tempfile.mkdtemp(prefix="bench-series-"))
    try:
        results = [bench_dtype(d, args, tmp) for d in args.dtypes]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    data = {
        "command": "python benchmarks/bench_series.py " + " ".join(sys.argv[1:]),
        "commit": _commit(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "threads": args.threads, "cold": args.cold,
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "loadavg": round(os.getloadavg()[0], 1),
        "goal": "point <= 3x read (issue 19), SVD off",
        "kernel": series_kernel.kernel() is not None,
        "results": results,
    }
    md = table(data)
    print(md)
    if not args.no_save:
        out = Path(args.out)
        out.write_text(json.dumps(data, indent=1))
        out.with_suffix(".md").write_text(md)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
