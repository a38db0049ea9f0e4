"""Benchmark: per-sample squared gradients (the `sequence` diagonal Fisher) on the same sampled
sequences, by every method we could run, against the plain batched forward+backward floor.

Methods (all compute sum_n g_n^2 over the N rows, except the floor):
  floor       one batched forward + backward of the summed log-prob (no per-sample anything)
  fisherlens  compute.fisher.fisher_from_samples(estimator="sequence")
  naive       one forward + backward per row (what the FISH-mask code does)
  vmap(grad)  torch.func.vmap(torch.func.grad(functional_call(model))) over rows, chunked
  opacus      opacus.GradSampleModule (functorch fallback for layers it does not know)
  token       fisherlens token estimator (reported relative to fisherlens sequence)

Each configuration runs with padding (the sampled, right-padded rows) and without (every row cut
to the shortest row's length). Times are the fastest of --repeats round-robin runs after one warm-up (the machine
may be shared; medians are in the JSON); peak
memory is the peak RSS increase over the call (CPU, sampled every 5 ms in a separate run) or the CUDA peak
allocation increase. Usage: python benchmarks/bench_fisher.py [--rows 16 --new-tokens 16 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compute.fisher import fisher_from_samples, trainable_parameters  # noqa: E402
from compute.sampling import position_ids_from_mask, sample_completions  # noqa: E402

# ---- memory ------------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory increase (bytes) during the block: CUDA allocator, or sampled process RSS."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = _rss()
        self.max = self.base
        self.stop = False

        def poll() -> None:
            while not self.stop:
                self.max = max(self.max, _rss())
                time.sleep(0.005)

        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            return
        self.stop = True
        self.thread.join()
        self.peak = max(self.max, _rss()) - self.base


# ---- methods -----------------------------------------------------------------------------------


def _loss(model, ids, am, cm):
    logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am),
                   use_cache=False).logits
    lp = logits[:, :-1].float().log_softmax(-1)
    tok = lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (tok * cm[:, 1:].float()).sum()


def m_floor(model, ids, am, cm):
    model.zero_grad(set_to_none=True)
    _loss(model, ids, am, cm).backward()
    out = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def m_fisherlens(model, ids, am, cm):
    return fisher_from_samples(model, ids, am, cm, estimator="sequence")


def m_token(model, ids, am, cm):
    return fisher_from_samples(model, ids, am, cm, estimator="token")


def m_naive(model, ids, am, cm):
    params = trainable_parameters(model)
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    for r in range(ids.shape[0]):
        n = int(am[r].sum())
        model.zero_grad(set_to_none=True)
        _loss(model, ids[r : r + 1, :n], am[r : r + 1, :n], cm[r : r + 1, :n]).backward()
        for name, p in params.items():
            if p.grad is not None:
                acc[name] += p.grad.float().square()
    model.zero_grad(set_to_none=True)
    return {k: v / ids.shape[0] for k, v in acc.items()}


def m_vmap(model, ids, am, cm, chunk=4):
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in trainable_parameters(model).items()}
    buffers = {n: b for n, b in model.named_buffers()}

    def row_loss(p, i, a, c):
        kw = {"input_ids": i[None], "use_cache": False}
        if not unpadded:  # HF mask building is data-dependent; only pass a mask when needed
            kw.update(attention_mask=a[None], position_ids=position_ids_from_mask(a[None]))
        out = functional_call(model, (p, buffers), args=(), kwargs=kw)
        lp = out.logits[0, :-1].float().log_softmax(-1)
        tok = lp.gather(-1, i[1:].unsqueeze(-1)).squeeze(-1)
        return (tok * c[1:].float()).sum()

    unpadded = bool(am.all())
    g = vmap(grad(row_loss), in_dims=(None, 0, 0, 0))
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    for s in range(0, ids.shape[0], chunk):
        gs = g(params, ids[s : s + chunk], am[s : s + chunk], cm[s : s + chunk])
        for n in acc:
            acc[n] += gs[n].float().square().sum(0)
    return {k: v / ids.shape[0] for k, v in acc.items()}


def m_opacus(model, ids, am, cm):
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=False)
    was_training = model.training
    model.train()  # opacus only captures activations in train mode (all dropouts are 0 here)
    try:
        gsm.zero_grad(set_to_none=True)
        logits = gsm(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am),
                     use_cache=False).logits
        lp = logits[:, :-1].float().log_softmax(-1)
        tok = lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        (tok * cm[:, 1:].float()).sum().backward()
        out = {}
        for n, p in model.named_parameters():
            gsamp = getattr(p, "grad_sample", None)
            if gsamp is None:
                raise RuntimeError(f"no grad_sample for {n}")
            out[n] = gsamp.float().square().sum(0) / ids.shape[0]
        return out
    finally:
        model.train(was_training)
        gsm.zero_grad(set_to_none=True)
        gsm._close()
        for p in model.parameters():
            for attr in ("grad_sample", "_forward_counter", "summed_grad"):
                if hasattr(p, attr):
                    delattr(p, attr)


METHODS = {"floor": m_floor, "fisherlens": m_fisherlens, "naive": m_naive, "vmap(grad)": m_vmap,
           "opacus": m_opacus, "token": m_token}

# ---- harness -----------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_methods(names, model, data, device, repeats):
    """Warm-up every method once, then time them round-robin (so load spikes on the shared machine
    hit all methods alike) and keep each method's fastest run; one extra run measures memory."""
    ids, am, cm = data
    stats, outs = {}, {}
    for name in names:
        print(f"    warm-up {name}", flush=True)
        try:
            outs[name] = METHODS[name](model, ids, am, cm)
            stats[name] = {"times": []}
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this model is reported
            msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
            stats[name] = {"error": f"n/a: {type(exc).__name__}: {msg}"}
    ok = [n for n in names if "error" not in stats[n]]
    for _ in range(repeats):
        for name in ok:
            _sync(device)
            t0 = time.perf_counter()
            METHODS[name](model, ids, am, cm)
            _sync(device)
            stats[name]["times"].append(time.perf_counter() - t0)
    for name in ok:
        with PeakMemory(device) as pm:
            METHODS[name](model, ids, am, cm)
        st = stats[name]
        st["seconds"] = min(st["times"])
        st["median_seconds"] = statistics.median(st["times"])
        st["peak_mb"] = pm.peak / 2**20
        print(f"    {name}: {st['seconds']:.3f}s (median {st['median_seconds']:.3f}s)", flush=True)
    return stats, outs


def max_rel_diff(a, b):
    worst = 0.0
    for n in b:
        if n in a:
            scale = float(b[n].abs().max()) or 1.0
            worst = max(worst, float((a[n].float().cpu() - b[n].float().cpu()).abs().max()) / scale)
    return worst


def qwen3_20m(vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=384, intermediate_size=1024,
                      num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                      head_dim=64, tie_word_embeddings=False, max_position_embeddings=512,
                      pad_token_id=0, eos_token_id=1)
    return Qwen3ForCausalLM(cfg).eval()


def synthetic_tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` symbols (token i <-> 't<i>'), pad 0, eos 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def unpadded(ids, am, cm):
    """Every row cut to the shortest row: no padding at all, same tokens otherwise."""
    L = int(am.sum(1).min())
    return ids[:, :L].contiguous(), am[:, :L].contiguous(), cm[:, :L].contiguous()


def bench_model(label, model, tok, prompts, args, device):
    model.to(device)
    roll = sample_completions(model, tok, prompts, args.samples, args.new_tokens, seed=0)
    padded = (roll.input_ids, roll.attention_mask, roll.completion_mask)
    results = []
    n_params = sum(p.numel() for p in model.parameters())
    for pad_label, data in (("padded", padded), ("no padding", unpadded(*padded))):
        if int(data[2][:, 1:].sum()) == 0:
            continue
        row = {"model": label, "params": n_params, "padding": pad_label, "rows": data[0].shape[0],
               "length": data[0].shape[1], "tokens": int(data[1].sum()),
               "completion_tokens": int(data[2].sum()), "methods": {}}
        names = ["floor", "fisherlens", *[m for m in args.methods
                                          if m not in ("floor", "fisherlens")]]
        names = [n for n in names if n not in args.skip]
        print(f"  {label} / {pad_label}: {data[0].shape[0]} rows x {data[0].shape[1]} tokens",
              flush=True)
        stats, outs = run_methods(names, model, data, device, args.repeats)
        ref = outs.get("fisherlens")
        for name, out in outs.items():
            if ref is not None and name not in ("floor", "token", "fisherlens"):
                stats[name]["max_rel_diff_vs_fisherlens"] = max_rel_diff(out, ref)
        row["methods"] = stats
        floor = row["methods"]["floor"]["seconds"]
        seq = row["methods"]["fisherlens"]["seconds"]
        for st in row["methods"].values():
            if "seconds" in st:
                st["samples_per_s"] = row["rows"] / st["seconds"]
                st["x_floor"] = st["seconds"] / floor
        if "seconds" in row["methods"].get("token", {}):
            row["methods"]["token"]["x_sequence"] = row["methods"]["token"]["seconds"] / seq
        results.append(row)
    return results


def table(results) -> str:
    lines = ["| model | padding | method | time (s) | samples/s | peak mem (MB) | x floor | "
             "note |", "|---|---|---|---:|---:|---:|---:|---|"]
    for row in results:
        for name, st in row["methods"].items():
            if "error" in st:
                lines.append(f"| {row['model']} | {row['padding']} | {name} | - | - | - | - | "
                             f"{st['error']} |")
                continue
            note = []
            if "max_rel_diff_vs_fisherlens" in st:
                note.append(f"max rel diff vs fisherlens {st['max_rel_diff_vs_fisherlens']:.1e}")
            if "x_sequence" in st:
                note.append(f"{st['x_sequence']:.1f}x sequence; {row['completion_tokens']} "
                            f"token samples")
            lines.append(
                f"| {row['model']} | {row['padding']} | {name} | {st['seconds']:.3f} | "
                f"{st['samples_per_s']:.1f} | {st['peak_mb']:.0f} | {st['x_floor']:.2f} | "
                f"{'; '.join(note)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-prompts", type=int, default=8, help="prompts (rows = prompts x samples)")
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=12, help="max new tokens per completion")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=8192, help="vocab of the random Qwen3 model")
    ap.add_argument("--models", nargs="+", default=["arith-base", "qwen3-20m"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--skip", nargs="*", default=[], help="methods to skip")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = []
    for name in args.models:
        if name == "arith-base":
            try:
                from compute.modelref import resolve_model
                from compute.models import load_model

                model, tok = load_model(resolve_model("arith-base"), device=device,
                                        dtype="float32")
            except Exception as exc:  # noqa: BLE001
                print(f"skipping arith-base: {str(exc).splitlines()[0]} "
                      "(run `fisherlens zoo build` or set FISHERLENS_HOME)")
                continue
            from compute.tasks import get_task

            prompts = [e.prompt for e in get_task("arithmetic").examples(args.rows_prompts, seed=0)]
        else:
            model, tok = qwen3_20m(args.vocab), synthetic_tokenizer(args.vocab)
            g = torch.Generator().manual_seed(0)
            prompts = [" ".join(f"t{int(t)}" for t in torch.randint(3, args.vocab, (4 + i % 5,),
                                                                   generator=g))
                       for i in range(args.rows_prompts)]
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params", flush=True)
        results += bench_model(name, model, tok, prompts, args, device)
        del model
    text = table(results)
    print(text)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"torch": torch.__version__, "device": str(device), "threads": args.threads,
            "args": vars(args), "time": stamp}
    path = out_dir / f"bench_fisher-{stamp}.json"
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out_dir / "bench_fisher-latest.md").write_text(text + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
