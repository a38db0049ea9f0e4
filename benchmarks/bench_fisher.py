"""Benchmark: the exact per-sample Fisher engine against the plain batched forward+backward floor.

On the same sampled rows (sampled on-policy from each model, seed 0), per model:
  floor        one batched forward + backward of the summed completion log-prob (parameter .grad,
               nothing per-sample): per-sample squared gradients cannot cost much less
  sequence     compute.fisher.fisher_from_samples(estimator="sequence")
  naive        one forward + backward per row (what the FISH-mask code does)
  token        compute.fisher.fisher_from_samples(estimator="token")
  token-floor  the floor over the token estimator's own expanded batch (one truncated row per
               counted token, compute.fisher.expand_tokens): what `token` is compared with
  opacus, vmap(grad)   peers, only with --methods (slow on the larger models)

Timing: one warm-up of every method, then --repeats rounds; each round runs every method once,
in an order rotated every round (so drifting load on a shared machine hits all methods alike),
each call after the free memory of the calls before it went back to the system (glibc's
malloc_trim, untimed: a job starts after its predecessor's trim).
Reported per method: median, quartiles and range of the times, and the median (with quartiles)
of the per-round ratio to the floor measured in the same round (`x floor`; `token` is compared
with `token-floor`).

Peak memory: on CUDA, torch.cuda.max_memory_allocated over one call (after reset) minus what was
allocated before it; on CPU, the RSS high-water mark (VmHWM) of a fresh child process that loads
the model and the saved rows, resets the mark (/proc/self/clear_refs) and runs the method once,
minus its RSS before the call: the method's own peak, not a sampled guess.

Exactness: sequence is compared with naive (max abs difference / max value, per tensor).

Writes benchmarks/results/bench_fisher.json; `python benchmarks/tables.py` turns it into the
markdown table quoted by benchmarks/README.md. Usage:
  .venv/bin/python benchmarks/bench_fisher.py [--models qwen3-20m smollm2-135m:4x2x8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compute.fisher import expand_tokens, fisher_from_samples, trainable_parameters  # noqa: E402
from compute.lm.sampling import position_ids_from_mask, sample_completions  # noqa: E402
from compute.runtime.memory import release_freed_memory  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peakmem import rss_peak_of  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_METHODS = ["floor", "sequence", "naive", "token", "token-floor"]
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "The largest planet in the solar system is",
    "In 1492, Columbus",
    "A good way to learn programming is",
    "The opposite of hot is",
    "Photosynthesis is the process by which",
    "My favourite food is",
]

# ---- models and rows ---------------------------------------------------------------------------


def qwen3_20m(vocab: int = 8192) -> Any:
    """A randomly initialised Qwen3 of 18.9M parameters (hidden 384, 8 layers, untied)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=384, intermediate_size=1024,
                      num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                      head_dim=64, tie_word_embeddings=False, max_position_embeddings=512,
                      pad_token_id=0, eos_token_id=1)
    return Qwen3ForCausalLM(cfg).eval()


def synthetic_tokenizer(vocab: int = 8192) -> Any:
    """A word-level tokenizer over `vocab` symbols (token i <-> 't<i>'), pad 0, eos 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def load(name: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, list[str]]:
    """(model, tokenizer, prompts) for a benchmark model name; ValueError if it is not there."""
    if name == "qwen3-20m":
        g = torch.Generator().manual_seed(0)
        prompts = [" ".join(f"t{int(t)}" for t in torch.randint(3, 8192, (4 + i % 5,), generator=g))
                   for i in range(8)]
        return qwen3_20m().to(device=device, dtype=dtype), synthetic_tokenizer(), prompts
    from compute.lm.causal_lm import load_model

    model, tok = load_model(name, device=device, dtype=dtype)
    if name == "smollm2-135m":
        return model, tok, SMOLLM2_PROMPTS
    from compute.lm.verifiable_tasks import get_task

    return model, tok, [e.prompt for e in get_task("arithmetic").examples(8, seed=0)]


# ---- methods -----------------------------------------------------------------------------------


def _loss(model, ids, am, cm):
    logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am),
                   use_cache=False).logits  # (B, L, V)
    lp = logits[:, :-1].float().log_softmax(-1)  # (B, L-1, V)
    tok = lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L-1)
    return (tok * cm[:, 1:].float()).sum()


def m_floor(model, data):
    ids, am, cm = data["rows"]
    model.zero_grad(set_to_none=True)
    _loss(model, ids, am, cm).backward()
    out = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def m_token_floor(model, data):
    ids, am, cm = data["expanded"]
    model.zero_grad(set_to_none=True)
    _loss(model, ids, am, cm).backward()
    model.zero_grad(set_to_none=True)
    return None


def m_sequence(model, data):
    return fisher_from_samples(model, *data["rows"], estimator="sequence")


def m_token(model, data):
    return fisher_from_samples(model, *data["rows"], estimator="token")


def m_naive(model, data):
    ids, am, cm = data["rows"]
    params = trainable_parameters(model)
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    for r in range(ids.shape[0]):
        keep = am[r].bool()
        model.zero_grad(set_to_none=True)
        _loss(model, ids[r : r + 1, keep], am[r : r + 1, keep], cm[r : r + 1, keep]).backward()
        for name, p in params.items():
            if p.grad is not None:
                acc[name] += p.grad.float().square()
    model.zero_grad(set_to_none=True)
    return {k: v / ids.shape[0] for k, v in acc.items()}


def m_vmap(model, data, chunk=4):
    from torch.func import functional_call, grad, vmap

    ids, am, cm = data["rows"]
    params = {n: p.detach() for n, p in trainable_parameters(model).items()}
    buffers = dict(model.named_buffers())
    unpadded = bool(am.all())

    def row_loss(p, i, a, c):
        kw = {"input_ids": i[None], "use_cache": False}
        if not unpadded:  # HF mask building is data-dependent; only pass a mask when needed
            kw.update(attention_mask=a[None], position_ids=position_ids_from_mask(a[None]))
        out = functional_call(model, (p, buffers), args=(), kwargs=kw)
        lp = out.logits[0, :-1].float().log_softmax(-1)
        return (lp.gather(-1, i[1:].unsqueeze(-1)).squeeze(-1) * c[1:].float()).sum()

    g = vmap(grad(row_loss), in_dims=(None, 0, 0, 0))
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    for s in range(0, ids.shape[0], chunk):
        gs = g(params, ids[s : s + chunk], am[s : s + chunk], cm[s : s + chunk])
        for n in acc:
            acc[n] += gs[n].float().square().sum(0)
    return {k: v / ids.shape[0] for k, v in acc.items()}


def m_opacus(model, data):
    from opacus import GradSampleModule

    ids, am, cm = data["rows"]
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=False)
    was_training = model.training
    model.train()  # opacus only captures activations in train mode (all dropouts are 0 here)
    try:
        gsm.zero_grad(set_to_none=True)
        logits = gsm(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am),
                     use_cache=False).logits
        lp = logits[:, :-1].float().log_softmax(-1)
        (lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) * cm[:, 1:].float()).sum().backward()
        return {n: p.grad_sample.float().square().sum(0) / ids.shape[0]
                for n, p in model.named_parameters()}
    finally:
        model.train(was_training)
        gsm.zero_grad(set_to_none=True)
        gsm._close()
        for p in model.parameters():
            for attr in ("grad_sample", "_forward_counter", "summed_grad"):
                if hasattr(p, attr):
                    delattr(p, attr)


METHODS = {"floor": m_floor, "sequence": m_sequence, "naive": m_naive, "token": m_token,
           "token-floor": m_token_floor, "vmap(grad)": m_vmap, "opacus": m_opacus}
REFERENCE = {"token": "token-floor"}  # x floor of a method is against this method (else floor)

# ---- harness -----------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs),
            "max": max(xs), "n": len(xs)}


def max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for n in b:
        scale = float(b[n].abs().max()) or 1.0
        worst = max(worst, float((a[n].float().cpu() - b[n].float().cpu()).abs().max()) / scale)
    return worst


def time_methods(names, model, data, device, repeats):
    """Warm-up, then `repeats` rounds in rotated order; per-round times of every method."""
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    outs: dict[str, Any] = {}
    for name in names:
        print(f"    warm-up {name}", flush=True)
        try:
            outs[name] = METHODS[name](model, data)
            times[name] = []
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this model is reported
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
            errors[name] = f"{type(exc).__name__}: {first}"
            print(f"    {name}: {errors[name]}", flush=True)
    ok = [n for n in names if n in times]
    for r in range(repeats):
        order = ok[r % len(ok):] + ok[: r % len(ok)]
        for name in order:
            # each call starts from a heap whose free memory was handed back, as a job starts
            # after the one before it (its runner trims at its end): otherwise the next method's
            # own trim gives back what the one before kept (1.2 GB after `token`, 75 ms of
            # malloc_trim charged to `sequence`; 7 ms for its own 110 MB; session 22)
            release_freed_memory()
            _sync(device)
            t0 = time.perf_counter()
            METHODS[name](model, data)
            _sync(device)
            times[name].append(time.perf_counter() - t0)
        print(f"    round {r + 1}/{repeats}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in ok),
              flush=True)
    return times, errors, outs


def cuda_peak(name, model, data, device) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    METHODS[name](model, data)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def child_peak(model_name: str, method: str, data_path: Path, args) -> float:
    """Peak RSS increase (MiB) of `method`, run once in a fresh process that first loads the
    model and rows (its allocator starts clean, unlike the timing process)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", model_name, method,
           str(data_path), "--threads", str(args.threads), "--dtype", args.dtype]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["peak_mb"])


def child_main(model_name: str, method: str, data_path: str, args) -> None:
    torch.set_num_threads(args.threads)
    model, _, _ = load(model_name, torch.device("cpu"), _dtype(args.dtype, torch.device("cpu")))
    data = torch.load(data_path)
    peak = rss_peak_of(lambda: METHODS[method](model, data))
    print(json.dumps({"peak_mb": peak}))


def _dtype(name: str, device: torch.device) -> torch.dtype:
    from compute.lm.causal_lm import resolve_dtype

    return resolve_dtype(name, device)


def parse_model(spec: str, args) -> tuple[str, int, int, int]:
    """'name' or 'name:PxSxT' (prompts x samples x new tokens for that model only)."""
    name, _, size = spec.partition(":")
    if not size:
        return name, args.prompts, args.samples, args.new_tokens
    try:
        p, s, t = (int(x) for x in size.split("x"))
    except ValueError:
        raise SystemExit(f"--models: {spec!r}; write NAME or NAME:PROMPTSxSAMPLESxTOKENS, "
                         "e.g. smollm2-135m:4x2x8") from None
    return name, p, s, t


def bench_model(spec: str, args, device: torch.device, tmp: Path) -> dict[str, Any] | None:
    name, n_prompts, n_samples, new_tokens = parse_model(spec, args)
    dtype = _dtype(args.dtype, device)
    try:
        model, tok, prompts = load(name, device, dtype)
    except ValueError as exc:
        print(f"skipping {name}: {exc}", flush=True)
        return None
    roll = sample_completions(model, tok, prompts[:n_prompts], n_samples, new_tokens, seed=0)
    rows = (roll.input_ids, roll.attention_mask, roll.completion_mask)
    ex = expand_tokens(*(t.cpu() for t in rows))[:3]
    data = {"rows": rows, "expanded": tuple(t.to(device) for t in ex)}
    n_params = sum(p.numel() for p in model.parameters())
    row: dict[str, Any] = {
        "model": name, "params": n_params, "prompts": n_prompts, "samples": n_samples,
        "new_tokens": new_tokens, "dtype": str(dtype).replace("torch.", ""),
        "rows": int(rows[0].shape[0]), "length": int(rows[0].shape[1]),
        "real_tokens": int(rows[1].sum()), "padding_fraction": 1 - float(rows[1].float().mean()),
        "completion_tokens": int(rows[2].sum()), "expanded_rows": int(ex[0].shape[0]),
        "expanded_length": int(ex[0].shape[1]),
    }
    print(f"{name}: {n_params / 1e6:.1f}M params, {row['rows']} rows x {row['length']} tokens "
          f"({row['padding_fraction']:.0%} padding), token estimator: {row['expanded_rows']} rows",
          flush=True)
    names = [m for m in args.methods if m in METHODS]
    times, errors, outs = time_methods(names, model, data, device, args.repeats)
    methods: dict[str, Any] = {}
    for m in names:
        if m in errors:
            methods[m] = {"error": errors[m]}
            continue
        ref = REFERENCE.get(m, "floor")
        st: dict[str, Any] = {"times": times[m], "seconds": quartiles(times[m])}
        if ref in times and m != ref:
            ratios = [t / f for t, f in zip(times[m], times[ref], strict=True)]
            st["x_ref"] = quartiles(ratios)
            st["ref"] = ref
        methods[m] = st
    if "sequence" in outs and "naive" in outs:
        methods["sequence"]["max_rel_diff_vs_naive"] = max_rel_diff(outs["sequence"], outs["naive"])
    del outs
    # peak memory
    ok = [m for m in names if m not in errors]
    if device.type == "cuda":
        for m in ok:
            methods[m]["peak_mb"] = cuda_peak(m, model, data, device)
        row["memory"] = "torch.cuda.max_memory_allocated during one call, minus allocated before"
    else:
        path = tmp / f"{name}.pt"
        torch.save({"rows": tuple(t.cpu() for t in rows), "expanded": ex}, path)
        del model
        for m in ok:
            print(f"    memory {m}", flush=True)
            methods[m]["peak_mb"] = child_peak(name, m, path, args)
        row["memory"] = ("RSS high-water mark (VmHWM, reset after loading) of a fresh child "
                         "process running the method once, minus its RSS before the call")
    row["methods"] = methods
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-20m", "smollm2-135m:4x2x8"],
                    help="qwen3-20m, smollm2-135m (after `fisherlens zoo add smollm2-135m`), or "
                    "any zoo name / model folder; NAME:PxSxT sets prompts x samples x new tokens "
                    "for that model")
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                    help=f"of {', '.join(METHODS)}")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=12, help="max new tokens per completion")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | auto")
    ap.add_argument("--out", default=str(RESULTS / "bench_fisher.json"))
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "METHOD", "DATA"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(*args.child, args)
        return
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t0 = time.time()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            row = bench_model(name, args, device, Path(tmp))
            if row is not None:
                results.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    meta = {
        "command": "python benchmarks/bench_fisher.py " + " ".join(sys.argv[1:]),
        "git_commit": commit, "torch": torch.__version__, "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "cpu_count": os.cpu_count(), "threads": args.threads,
        "load_average_at_end": os.getloadavg(), "wall_seconds": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out} ({meta['wall_seconds']:.0f}s); tables: python benchmarks/tables.py")


if __name__ == "__main__":
    main()
