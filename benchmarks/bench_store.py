"""Artifact store: the folder backend before and after the object-store work, and S3 via moto.

Question: is the embedded default (the local folder store) unchanged and as fast as before, and
what does an object store add? One run, one process, the same tensors for every backend:

- `folder-before`: storage/artifacts.py as it was at the base commit (`--base`, default the
  merge-base with main), loaded from git into a module of its own;
- `folder-after`: this tree's `open_store(settings)` with no ARTIFACT_URL (the folder backend);
- `s3-moto`: this tree's `open_store(settings)` with ARTIFACT_URL=s3://... against moto in server
  mode in this process (a real S3 HTTP server, but Python and in memory: it says what the code
  path costs, not what MinIO or S3 on a network would).

Per size (a Fisher-sized dict of float32 tensors: `--mib`, default 1 and 64 MiB), each round
runs every backend once, in an order rotated every round; each backend:
  save        save_tensors(job, "fisher", tensors): serialize, write (folder) or upload + verify
              by HEAD + seed the writer's cache (S3)
  fetch cold  fetch(rel, sha256) on a reader that has not seen it: verify the file in place
              (folder: one sha256 pass) or download + sha256 + install into a fresh cache (S3)
  fetch warm  the same fetch again (folder: fingerprint unchanged, no hashing; S3: cache hit)
Times are medians over `--rounds` (default 11) after one warm-up round, wall-clock and CPU time
of this process (the second is less sensitive to a busy shared machine; for s3-moto it includes
the server's threads); `x before` is the median of the per-round ratio to folder-before.

    .venv/bin/python benchmarks/bench_store.py                 # writes results/bench_store.json
    .venv/bin/python benchmarks/bench_store.py --mib 8 --rounds 3 --no-save
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
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
OPS = ("save", "fetch cold", "fetch warm")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def load_before(base: str, folder: Path) -> Any:
    """The folder store at commit `base`, as its own module (it imports only stdlib and
    safetensors)."""
    src = _git("show", f"{base}:storage/artifacts.py")
    path = folder / "artifacts_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("artifacts_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["artifacts_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def fisher_like(mib: float) -> dict[str, Any]:
    """float32 tensors of `mib` MiB in layer-like shapes (the key layout of a Fisher artifact)."""
    import torch

    g = torch.Generator().manual_seed(0)
    n = int(mib * 2**20 / 4)
    out: dict[str, Any] = {}
    k = 0
    while n > 0:
        size = min(n, 256 * 1024 if k % 3 else 512 * 1024)
        out[f"model.layers.{k // 3}.w{k % 3}"] = torch.rand(size, generator=g) ** 4
        n -= size
        k += 1
    return out


class Backend:
    """One backend: a writer and a fresh reader per round (the S3 reader is another machine:
    its own cache)."""

    def __init__(self, name: str, make_writer: Any, make_reader: Any):
        self.name, self.make_writer, self.make_reader = name, make_writer, make_reader

    def round(self, job_id: int, tensors: dict[str, Any], tmp: Path) -> dict[str, float]:
        writer = self.make_writer(tmp)
        reader = self.make_reader(tmp)  # made (clients, settings) before any timing
        clock = [(time.perf_counter(), time.process_time())]
        info = writer.save_tensors(job_id, "fisher", tensors)
        clock.append((time.perf_counter(), time.process_time()))
        path = reader.fetch(info.path, info.sha256)
        clock.append((time.perf_counter(), time.process_time()))
        again = reader.fetch(info.path, info.sha256)
        clock.append((time.perf_counter(), time.process_time()))
        assert again == path and path.stat().st_size == info.bytes
        release = getattr(reader, "release", None)
        if release is not None:
            release()
        out: dict[str, float] = {"bytes": info.bytes}
        for i, op in enumerate(OPS):
            out[op] = clock[i + 1][0] - clock[i][0]
            out[f"{op} cpu"] = clock[i + 1][1] - clock[i][1]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, nargs="+", default=[1.0, 64.0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--base", default=None, help="commit of the 'before' folder store "
                    "(default: git merge-base HEAD main)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    from compute.contract.settings import Settings
    from storage.artifacts import open_store
    from tests.s3 import moto_s3

    base = args.base or _git("merge-base", "HEAD", "main")
    load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    before = load_before(base, work)
    results: dict[str, Any] = {}
    with moto_s3() as s3:
        s3_env = {"artifact_url": s3.url("bench"), "aws_endpoint_url": s3.endpoint,
                  "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                  "aws_default_region": "us-east-1"}
        counter = iter(range(10**9))

        def s3_machine(tmp: Path) -> Any:
            return open_store(Settings(fisherlens_home=tmp / f"m{next(counter)}", **s3_env))

        backends = [
            Backend("folder-before", lambda t: before.ArtifactStore(t / "art"),
                    lambda t: before.ArtifactStore(t / "art")),
            Backend("folder-after", lambda t: open_store(Settings(fisherlens_home=t)),
                    lambda t: open_store(Settings(fisherlens_home=t))),
            Backend("s3-moto", s3_machine, s3_machine),
        ]
        job = iter(range(1, 10**9))
        for mib in args.mib:
            tensors = fisher_like(mib)
            keys = [*OPS, *(f"{op} cpu" for op in OPS)]
            times: dict[str, dict[str, list[float]]] = {b.name: {k: [] for k in keys} for b in backends}
            size = 0
            for r in range(args.rounds + 1):  # round 0: warm-up, not counted
                order = backends[r % len(backends):] + backends[:r % len(backends)]
                for b in order:
                    out = b.round(next(job), tensors, work)
                    size = int(out["bytes"])
                    if r > 0:
                        for k in keys:
                            times[b.name][k].append(out[k])
            row: dict[str, Any] = {"bytes": size, "backends": {}}
            ref = times["folder-before"]
            for b in backends:
                t = times[b.name]
                row["backends"][b.name] = {
                    k: {"median_s": statistics.median(t[k]),
                        "x_before": statistics.median(a / max(z, 1e-9) for a, z in zip(t[k], ref[k],
                                                                                         strict=True))}
                    for k in keys
                }
            results[f"{mib:g} MiB"] = row
    payload = {
        "benchmark": "bench_store",
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "base_commit": base,
        "head_commit": _git("rev-parse", "HEAD"),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        "rounds": args.rounds,
        "load_average_at_start": load_at_start,
        "note": "s3-moto is moto's in-memory Python server in the benchmark process: the cost of "
                "the code path, not of MinIO/S3 over a network",
        "sizes": results,
    }
    print(f"artifact store: median of {args.rounds} rounds (x before = median per-round ratio "
          f"to folder-before); base {base[:10]}")
    for kind, suffix in (("wall-clock", ""), ("CPU time of this process", " cpu")):
        print(f"-- {kind}")
        print(f"{'size':>9} {'backend':<14}" + "".join(f"{op:>22}" for op in OPS))
        for label, row in results.items():
            for name, ops in row["backends"].items():
                cells = "".join(f"{ops[op + suffix]['median_s'] * 1e3:>11.1f} ms "
                                f"{ops[op + suffix]['x_before']:>5.2f}x " for op in OPS)
                print(f"{label:>9} {name:<14}{cells}")
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "bench_store.json").write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {RESULTS / 'bench_store.json'}")


if __name__ == "__main__":
    main()
