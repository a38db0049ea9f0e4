"""Drill-down speed on the largest tensor the explorer meets: a Gemma 3 270M embedding, 262,144 x
640 float32 (671 MB), random (lognormal, like a Fisher: many decades), in a safetensors file.

Timed, each in a fresh state of the explorer's cache (the page cache of the OS is warm after the
file is written, as it is on a server that just stored the artifact; `--cold` drops this file's
pages first with posix_fadvise(DONTNEED) for a first open from disk):
1. first open: app/explore/view.py `cached` building the numbers (the streamed pass of
   app/explore/tensors.py over the tensor read with safe_open/get_slice in row chunks) and
   storing the JSON in a folder artifact store;
2. cached open: the same call again (reads `<job>/explore-tensor-<key>.json`);
3. the view: the HTML + Plotly figures built from the cached numbers (what /tensor/view adds);
4. with `--overlay`: the same tensor as a diff's |delta| with a Fisher of the same shape (two
   reads per pass, two passes).
Peak memory of the first open: what Python and numpy allocated during it (tracemalloc; the
tensor is never held whole, only row chunks of CHUNK_ELEMENTS values).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_explore.py --overlay
    .venv/bin/python benchmarks/bench_explore.py --rows 30000 --no-save     # quick

Writes benchmarks/results/bench_explore.json (rendered in docs/explorer.md by
benchmarks/readme_tables.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _write(path: Path, name: str, rows: int, cols: int, seed: int) -> None:
    """A random float32 tensor written in row blocks (never two copies in memory)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    x = np.empty((rows, cols), dtype=np.float32)
    for r0 in range(0, rows, 16384):
        r1 = min(rows, r0 + 16384)
        x[r0:r1] = rng.lognormal(-12.0, 3.0, size=(r1 - r0, cols)).astype(np.float32)
    save_file({name: x}, str(path))
    del x


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=262_144)
    ap.add_argument("--cols", type=int, default=640)
    ap.add_argument("--overlay", action="store_true", help="also time a diff tensor with its Fisher")
    ap.add_argument("--cold", action="store_true", help="drop the file from the page cache before the first open")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    from app.explore import view
    from app.explore.sources import Source
    from compute.contract.settings import Settings

    name = "model.embed_tokens.weight"
    out: dict = {"shape": [args.rows, args.cols], "dtype": "float32", "cold": args.cold, "runs": []}
    with tempfile.TemporaryDirectory(prefix="fl-bench-explore-") as tmp:
        home = Path(tmp)
        settings = Settings(fisherlens_home=home, database_url=None, redis_url=None)
        fisher = home / "fisher.safetensors"
        _write(fisher, name, args.rows, args.cols, 0)
        inputs = {"fisher.safetensors": _sha256(fisher)}
        sources = [("fisher", Source("fisher", "Fisher", "max", True, {name: [fisher]}))]
        if args.overlay:
            delta = home / "delta.safetensors"
            _write(delta, name, args.rows, args.cols, 1)
            inputs["delta.safetensors"] = _sha256(delta)
            src = Source("diff", "|delta|", "max", True, {name: [delta]}, fisher={name: fisher})
            sources.append(("diff with Fisher overlay", src))
        for job_id, (label, src) in enumerate(sources, start=1):
            if args.cold:
                for paths in src.files.values():
                    for p in paths:
                        _drop_cache(p)
                if src.fisher:
                    _drop_cache(src.fisher[name])
            tracemalloc.start()
            t0 = time.perf_counter()
            first = view.cached(settings, job_id, "tensor", f"bench|{label}", lambda s=src: view.compute(s, name, 1.0))
            t1 = time.perf_counter()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            again = view.cached(settings, job_id, "tensor", f"bench|{label}", lambda: {})
            t2 = time.perf_counter()
            html = view.view_html(again)
            t3 = time.perf_counter()
            assert first["cached"] is False and again["cached"] is True
            size = next((home / "artifacts" / str(job_id)).glob("explore-tensor-*.json")).stat().st_size
            run = {"source": label, "first_open_s": round(t1 - t0, 3), "cached_open_s": round(t2 - t1, 4),
                   "view_html_s": round(t3 - t2, 4), "cache_json_bytes": size,
                   "first_open_peak_mb": round(peak / 1e6, 1), "view_html_bytes": len(html)}
            out["runs"].append(run)
            print(json.dumps(run), file=sys.stderr)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["tensor_mb"] = round(args.rows * args.cols * 4 / 1e6, 1)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    cmd = "python benchmarks/bench_explore.py" + (" --overlay" if args.overlay else "") + (
        " --cold" if args.cold else "") + (f" --rows {args.rows}" if args.rows != 262_144 else "")
    # no model: the inputs are random tensors (lognormal, seeds 0 and 1); their files' sha256
    out["provenance"] = {"command": cmd, "git": {"commit": commit, "dirty": dirty},
                         "models": {f"random {args.rows}x{args.cols} lognormal tensors": {"sha256": inputs}},
                         "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                     "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                                     "load_average_1min": round(os.getloadavg()[0], 2),
                                     "numpy": np.__version__}}
    print(json.dumps(out, indent=1))
    if not args.no_save:
        (ROOT / "benchmarks" / "results" / "bench_explore.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
