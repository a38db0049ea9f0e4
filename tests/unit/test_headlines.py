"""The first number is the one to quote (issue 18): for a real small result of every kind, every
key number and every figure title agrees with the stored summary value it summarizes.

Each kind is built once per module from the tiny zoo (arith-base, CPU) with tiny settings; the
expected headline of each item is computed here from the stored summary (as the database gives
it back), independently of app.figures.keynumbers. The bf16-mixed masked run reproduces the
issue's pair (fisher -> mask -> masked GRPO in bf16-mixed -> diff against the fp32 base): its
diff must lead with the bf16 comparison (>= 90% unchanged), not exact equality across precisions.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.ceiling import duration
from app.figures.keynumbers import fmt, key_numbers, pct
from app.figures.registry import entries, titled_figures_for
from compute.contract.results import reliability_level
from compute.jobs.registry import parse_result

TINY = {"steps": 2, "batch": 2, "group": 2, "max_new_tokens": 4, "eval_prompts": 4, "device": "cpu",
        "fisher_prompts": 2, "fisher_samples": 2}


class Builder:
    """Builds each kind on first use (so a fast test never waits for training)."""

    def __init__(self, home: Path, tmp: Path):
        self.home, self.tmp = home, tmp
        self.cache: dict[str, Any] = {}

    def env(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def ctx():
            keys = ("FISHERLENS_HOME", "FISHERLENS_DEVICE", "ALLOWED_MODEL_ROOTS")
            old = {k: os.environ.get(k) for k in keys}
            os.environ.update(FISHERLENS_HOME=str(self.home), FISHERLENS_DEVICE="cpu",
                              ALLOWED_MODEL_ROOTS=str(self.tmp))
            try:
                yield
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return ctx()

    def get(self, kind: str) -> dict[str, Any]:
        if kind not in self.cache:
            with self.env():
                res = getattr(self, f"_{kind.replace('-', '_')}")()
            self.cache[kind] = res
        return self.cache[kind]

    @staticmethod
    def stored(res: Any) -> dict[str, Any]:
        """The result as the database gives it back (JSON, NaN -> null)."""
        return json.loads(json.dumps(res.to_dict(), default=str).replace("NaN", "null"))

    def _fisher_file(self) -> str:
        from safetensors.torch import save_file

        res = self.get("fisher")["job"]
        path = self.tmp / "fisher.safetensors"
        if not path.exists():
            save_file(res.tensors["fisher"], str(path), metadata=res.metadata["fisher"])
        return str(path)

    def _fisher(self) -> dict[str, Any]:
        from compute.jobs import fisher_run as run_fisher
        from compute.jobs.fisher import FisherSpec

        res = run_fisher.run(FisherSpec(model="arith-base", prompts=4, samples=2, max_new_tokens=4,
                                        device="cpu", until_reliable=False))
        return {"job": res, "dict": self.stored(res)}

    def _mask(self) -> dict[str, Any]:
        from safetensors.torch import save_file

        from compute.jobs import mask_run as run_mask
        from compute.jobs.mask import MaskSpec

        res = run_mask.run(MaskSpec(fisher=self._fisher_file(), select="fisher", density=0.05))
        save_file(res.tensors["mask"], str(self.tmp / "mask.safetensors"), metadata=res.metadata.get("mask"))
        return {"job": res, "dict": self.stored(res)}

    def _train(self) -> dict[str, Any]:
        """The issue's run: GRPO on the Fisher mask, bf16-mixed (a bf16 checkpoint)."""
        import shutil

        from compute.jobs import train_run as run_train
        from compute.jobs.train import TrainSpec

        self.get("mask")
        res = run_train.run(TrainSpec(model="arith-base", mask=str(self.tmp / "mask.safetensors"),
                                      precision="bf16-mixed", lr=1e-2, save_steps=1, **TINY))
        out = self.tmp / "trained"
        shutil.move(res.files["model"], out)
        return {"job": res, "dict": self.stored(res), "model": str(out)}

    def _diff(self) -> dict[str, Any]:
        from compute.jobs import diff_run as run_diff
        from compute.jobs.diff import DiffSpec

        tuned = self.get("train")["model"]
        res = run_diff.run(DiffSpec(base="arith-base", tuned=tuned, fisher=self._fisher_file()))
        return {"job": res, "dict": self.stored(res)}

    def _series(self) -> dict[str, Any]:
        """The issue's series: the bf16 checkpoints of the masked bf16-mixed run vs the fp32 base."""
        from compute.jobs import series as run_series
        from compute.jobs.series import SeriesSpec

        run_dir = self.get("train")["model"]
        res = run_series.run(SeriesSpec(base="arith-base", run_dir=run_dir, fisher=self._fisher_file()))
        return {"job": res, "dict": self.stored(res)}

    def _diff_same(self) -> dict[str, Any]:
        """Two fp32 zoo checkpoints: exact equality is the convention that fits."""
        from compute.jobs import diff_run as run_diff
        from compute.jobs.diff import DiffSpec

        res = run_diff.run(DiffSpec(base="arith-base", tuned="arith-teacher"))
        return {"job": res, "dict": self.stored(res)}

    def _tokens(self) -> dict[str, Any]:
        from compute.jobs import tokens_run as run_tokens
        from compute.jobs.tokens import TokensSpec

        res = run_tokens.run(TokensSpec(model="arith-base", context="12+34=", top_k=3, random_k=2,
                                        low_k=2, device="cpu"))
        return {"job": res, "dict": self.stored(res)}

    def _sweep(self) -> dict[str, Any]:
        from compute.jobs import sweep_run as run_sweep
        from compute.jobs.sweep import SweepSpec

        res = run_sweep.run(SweepSpec(model="arith-base", lrs=[1e-3], optimizers=["sgd"],
                                      precision=["bf16-mixed"], fisher=self._fisher_file(), **TINY))
        return {"job": res, "dict": self.stored(res)}

    def _retention(self) -> dict[str, Any]:
        from compute.jobs import retention_run as run_retention
        from compute.jobs.retention import RetentionSpec

        res = run_retention.run(RetentionSpec(
            model="arith-base", densities=[0.1], selectors=["random"], seeds=1, bootstrap=100,
            **{**TINY, "eval_prompts": 8}))
        return {"job": res, "dict": self.stored(res)}


@pytest.fixture(scope="module")
def built(zoo_home, tmp_path_factory) -> Builder:
    return Builder(zoo_home, tmp_path_factory.mktemp("headlines"))


# ------------------------------------------------------------------ expected, from the summary


def _verdict_of(rel: dict[str, Any]) -> str:
    return rel.get("reliability") or reliability_level(rel.get("split_half_jaccard"))


def expected_fisher(d: dict[str, Any]) -> dict[str, str]:
    s = d["summary"]
    out = {"Fisher mass in the top 1% of coordinates": pct(s["top1%_share"]),
           "Fisher mass in the top 10%": pct(s["top10%_share"]),
           "Gini coefficient": fmt(s["gini"]),
           f"Split-half top-{fmt(s['split_half_topk_percent'])}% Jaccard": fmt(s["split_half_jaccard"]),
           "Samples": fmt(s["n_samples"]),
           "Precision": f"computed in {s['compute_dtype']}, stored in {s['stored_dtype']}"}
    errs = [v["relative_l1_error"] for v in (s.get("exact_output") or {}).values()]
    if errs:
        out["Output layer: relative L1 error vs exact"] = fmt(max(errs))
    return out


def expected_mask(d: dict[str, Any]) -> dict[str, str]:
    s = d["summary"]
    return {"Kept fraction": pct(s["density"]), "Fisher mass kept": pct(s["fisher_mass_kept"]),
            "Precision": f"computed in {s['compute_dtype']}, stored in {s['stored_dtype']}"}


def expected_train(d: dict[str, Any]) -> dict[str, str]:
    s = d["summary"]
    b, a = s["accuracy_before"], s["accuracy_after"]
    rewards = sorted((p["step"], p["value"]) for p in d["series"] if p["name"] == "train/reward")
    n = s["eval"]["prompts"]

    def se(p: float) -> str:  # issue 27: one binomial SE next to every accuracy, in points
        return f"{pct(p)} ± {100 * (p * (1 - p) / n) ** 0.5:.2g}"

    out = {"Held-out accuracy before -> after":
           f"{se(b)} -> {se(a)} ({'+' if a >= b else ''}{100 * (a - b):.3g} points)",
           "Trainable fraction (mask density)": pct(s["trainable_fraction"]),
           _train_unchanged_label(s): pct(s["update_sparsity"]["unchanged_exact"]),
           "Precision": f"computed in {s['compute_dtype']}, stored in {s['stored_dtype']}"}
    if len(rewards) >= 2:
        out["Sample reward, first -> last step"] = f"{fmt(rewards[0][1])} -> {fmt(rewards[-1][1])}"
    if "bound_violations" in (s.get("bound") or {}):
        out["Cauchy-Schwarz bound, first batch"] = f"{s['bound']['bound_violations']:,} violations"
    return out


def _train_unchanged_label(s: dict[str, Any]) -> str:
    us = s["update_sparsity"]
    if us.get("comparison_rule", "exact") == "exact":
        return "Stored weights exactly unchanged"
    return f"Stored weights unchanged, compared in {us['comparison_dtype']}"


def expected_series(d: dict[str, Any]) -> dict[str, str]:
    s = d["summary"]
    out = {"Checkpoints": str(len(s["steps"]))}
    label = ("Weights exactly unchanged at the last checkpoint (vs base)" if s["comparison_rule"] == "exact"
             else f"Weights unchanged at the last checkpoint (vs base), compared in {s['comparison_dtype']}")
    out[label] = pct(s["final_update_sparsity"])
    out["Unchanged per step (mean, step to step)"] = pct(s["mean_step_sparsity"])
    ratio = s["sparse_bytes_total"] / s["dense_bytes_total"]
    out["Sparse sync (indices + values) vs dense"] = pct(ratio) if ratio < 1 else f"{ratio:.3g}x dense"
    if s["sync_bytes_total"] < s["sparse_bytes_total"]:
        out["Cheaper of sparse and dense per tensor vs dense"] = pct(s["sync_bytes_total"] / s["dense_bytes_total"])
    if s.get("support_bytes_total") is not None:
        out["Fisher-support sync vs dense"] = pct(s["support_bytes_total"] / s["dense_bytes_total"])
    if s.get("mean_step_auc") is not None:
        out[_scoped("Fisher AUC for the coordinates a step changes (mean)", s)] = fmt(s["mean_step_auc"])
    return out


def expected_diff(d: dict[str, Any]) -> dict[str, str]:
    s = d["summary"]
    sd = s["stored_dtypes"]
    if s["comparison"].startswith("exact"):
        out = {"Weights exactly unchanged": pct(s["unchanged_exact"])}
    else:
        out = {f"Weights unchanged, compared in {s['comparison_dtype']}": pct(s["unchanged_common"])}
    out["Precision"] = f"base {sd['base']}, tuned {sd['tuned']}"
    if s.get("auc") is not None:
        k = s["overlap"][0]["k_percent"]  # the overlap table's k (every row has the spec's)
        out[_scoped(f"Fisher AUC for the top-{fmt(k)}% |delta| coordinates", s)] = fmt(s["auc"])
    else:
        out["Fisher AUC"] = "not computed"
    if s.get("changed_auc") is not None:
        out[_scoped("Fisher AUC for changed-at-all coordinates", s)] = fmt(s["changed_auc"])
    return out


def _scoped(label: str, s: dict[str, Any]) -> str:
    """issue 27: a masked run's Fisher metrics say they are inside the mask."""
    if (s.get("construction") or {}).get("trained_in_mask"):
        return f"{label} (inside the mask: the coordinates free to move)"
    return label


def expected_tokens(d: dict[str, Any]) -> dict[str, str]:
    s = d["summary"]
    best = max(s["top_tokens"], key=lambda t: t["prob"] or 0.0)
    sim = s["similarity"]
    assert sim["exact"] and s["fisher_exact"]  # arith-base's vocabulary is enumerated

    def change(removed: float, share: float) -> str:  # a sign in words, never "removes -136"
        return f"{'removes' if removed >= 0 else 'adds'} {fmt(abs(removed))} = {fmt(abs(share))} of F_orth"

    return {"Most likely next token": repr(best["token"]), "Next-token entropy": fmt(s["entropy"]),
            "Scope": s["scope"], "Fisher trace at this position": fmt(s["fisher_trace"]),
            f"Top {len(s['top_tokens'])} tokens": f"probability {pct(s['top_prob_mass'])}",
            "Mean off-diagonal cosine of sensitivities": (
                f"top {fmt(s['mean_cosine_top'])}, random {fmt(s['mean_cosine_random'])}, "
                f"low-probability {fmt(s['mean_cosine_low'])}"),
            "Similarity of the sensitivities": change(sim["removed"], sim["removed_share"]),
            "Precision": f"computed in {s['compute_dtype']}"}


def expected_sweep(d: dict[str, Any]) -> dict[str, str]:
    s = d["summary"]
    return {"Points (lr x optimizer x precision)": str(len(s["points"])),
            "Precision": f"computed in {s['compute_dtype']}, stored in {s['stored_dtype']}"}


def expected_retention(d: dict[str, Any]) -> dict[str, str]:
    s = d["summary"]
    base = fmt(s["base_reward"]) + (f" ± {fmt(s['base_se'])}" if s.get("base_se") is not None else "")
    out = {"Base model held-out reward": base,
           "Precision": f"computed in {s['compute_dtype']}, stored in {s['stored_dtype']}"}
    full = s.get("full_reward_mean")
    if full is not None:
        spread = s.get("full_reward_std")
        out["Full training held-out reward"] = fmt(full) + (f" ± {fmt(spread)}" if spread is not None else "")
    return out


EXPECTED: dict[str, Callable[[dict[str, Any]], dict[str, str]]] = {
    "fisher": expected_fisher, "mask": expected_mask, "train": expected_train, "diff": expected_diff,
    "diff-same": expected_diff, "tokens": expected_tokens, "sweep": expected_sweep, "series": expected_series,
    "retention": expected_retention}

# figure titles that carry numbers of the result, computed here from the summary
NUMBERED_TITLES: dict[tuple[str, str], Callable[[dict[str, Any]], str]] = {
    ("train", "bound"): lambda d: _bound_title(d["summary"]["bound"]),
    ("fisher", "concentration"): lambda d: f"Concentration of the Fisher (Gini {fmt(d['summary']['gini'])})",
    ("tokens", "tokens"): lambda d: f"Next tokens after {d['summary']['context'][-40:]!r}",
    ("tokens", "fisher_counterfactual"): lambda d: _counterfactual_title(d["summary"]["similarity"]),
    **{("tokens", f"similarity_{w}"): (lambda d, w=w: f"({w} tokens, mean off-diagonal "
                                        f"{fmt(d['summary'][f'mean_cosine_{w}'])})") for w in ("top", "random", "low")},
}


def _counterfactual_title(sim: dict[str, Any]) -> str:
    k = sim.get("top_k")
    if sim.get("exact"):  # issue 27: no double negative ("removes -136.2" reads "adds 136.2")
        def change(r: float, sh: float) -> str:
            return f"{'removes' if r >= 0 else 'adds'} {fmt(abs(r))} = {fmt(abs(sh))} of F_orth"
        return (f"similarity {change(sim['removed'], sim['removed_share'])}; "
                f"top-{k} pairs {change(sim['removed_top'], sim['removed_top_share'])}")
    return (f"removed <= {fmt(sim['removed_upper'])}, share <= {fmt(sim['removed_share_upper'])}; "
            f"top-{k} pairs remove {fmt(sim['removed_top'])}")


NUMBER = re.compile(r"(?<![\w.])\d[\d.,]*(?:e[-+]?\d+)?%?")  # not the 16 of bf16, the 10 of log10


def _bound_title(b: dict[str, Any]) -> str:
    n, v, mx = b["bound_coordinates"], b["bound_violations"], b.get("bound_max_ratio")
    if v == 0 and b["bound_rms_advantage"] == 0:  # a vacuous check is not "holds for all"
        return "no test of the bound: every advantage of the first batch is 0"
    verb = f"holds for all of {n:,}" if v == 0 else f"fails for {v:,} of {n:,}"
    return f"the bound {verb} coordinates" + (f" (max ratio {fmt(mx)})" if mx is not None else "")


def check_headlines(kind: str, d: dict[str, Any]) -> dict[str, Any]:
    """Every key number equals the expected value; every figure title is the registered one, or
    (where it carries numbers) the one computed from the summary."""
    nums = key_numbers(d)
    got = {i["label"]: i["value"] for i in nums["items"]}
    want = EXPECTED[kind](d)
    rec = (d.get("summary") or {}).get("completion_lengths")
    if rec:  # every kind that sampled: how many completions, the lower median of their lengths
        lengths = sorted([int(k) for k, v in rec["stopped"].items() for _ in range(v)] + [math.inf] * rec["open"])
        mid = lengths[(len(lengths) - 1) // 2]
        want["Completions"] = f"{rec['rows']:,} sampled, " + (
            f"median {mid} tokens" if mid != math.inf else f"median at the limit ({rec['max_new_tokens']} tokens or more)")
    parts = (d.get("summary") or {}).get("seconds_parts")
    if parts and not (d.get("job") or {}).get("started_at"):  # every kind: the parts' sum it took
        total = sum(parts.values())
        want["Time"] = f"took {total:.2g} s" if total < 10 else f"took {duration(total)}"
    assert got == want, (kind, got, want)
    r = parse_result(d)
    registered = {e.name: e.title for e in entries(r.kind)}
    for name, title, _fig in titled_figures_for(r):
        if (r.kind, name) in NUMBERED_TITLES:
            assert NUMBERED_TITLES[(r.kind, name)](d) in title, (name, title)
        elif name == "update_sparsity":
            hm = next(h for h in r.heatmaps if h.meta.get("headline"))
            assert title == f"Update sparsity: unchanged by {hm.meta['threshold_label']}", title
        else:
            # no number of the result in the title: only the digits its registered title has
            hm = r.heatmap(name)
            static = registered[name] + " " + str((hm.meta if hm else {}).get("title") or "")
            assert set(NUMBER.findall(title)) <= set(NUMBER.findall(static)), (kind, name, title)
    return nums


# ------------------------------------------------------------------ the tests, one per kind


def test_fisher_headlines(built):
    d = built.get("fisher")["dict"]
    nums = check_headlines("fisher", d)
    s = d["summary"]
    assert s["compute_dtype"] == "float32" and s["accumulate_dtype"] == "float32" and "precision_error" not in s
    assert nums["verdict"]["level"] == reliability_level(s["split_half_jaccard"])


def test_mask_headlines_show_the_fishers_verdict(built):
    d = built.get("mask")["dict"]
    check_headlines("mask", d)
    rel = d["summary"]["fisher_reliability"]
    fisher = built.get("fisher")["dict"]["summary"]
    assert rel["split_half_jaccard"] == fisher["split_half_jaccard"]
    assert key_numbers(d)["verdict"]["level"] == _verdict_of(rel) == reliability_level(fisher["split_half_jaccard"])


def test_diff_of_two_fp32_checkpoints_leads_with_exact_equality(built):
    d = built.get("diff-same")["dict"]
    check_headlines("diff-same", d)
    s = d["summary"]
    assert s["stored_dtypes"] == {"base": "float32", "tuned": "float32"} and s["comparison_dtype"] == "float32"
    assert s["unchanged_common"] == s["unchanged_exact"] == s["update_sparsity"]


def test_tokens_headlines(built):
    check_headlines("tokens", built.get("tokens")["dict"])


@pytest.mark.slow
def test_train_headlines_and_bound_title(built):
    d = built.get("train")["dict"]
    check_headlines("train", d)
    s = d["summary"]
    assert s["stored_dtype"] == "bfloat16" and s["compute_dtype"] == "float32"
    assert key_numbers(d)["verdict"]["level"] == _verdict_of(s["fisher_reliability"])


@pytest.mark.slow
def test_bf16_mixed_masked_diff_leads_with_the_bf16_comparison(built):
    """The issue's pair: exact equality across precisions reads ~0% unchanged; the headline must
    be the comparison in bf16 (the lower stored precision), as the train result says."""
    d = built.get("diff")["dict"]
    nums = check_headlines("diff", d)
    s = d["summary"]
    assert s["stored_dtypes"] == {"base": "float32", "tuned": "bfloat16"} and s["comparison_dtype"] == "bfloat16"
    first = nums["items"][0]
    assert first["label"] == "Weights unchanged, compared in bfloat16"
    assert s["unchanged_common"] >= 0.90 and s["unchanged_exact"] < 0.05
    assert s["unchanged_common"] == s["unchanged_bf16"] == s["update_sparsity"]
    train = built.get("train")["dict"]["summary"]["update_sparsity"]
    assert s["unchanged_common"] == pytest.approx(train["unchanged_exact"], abs=1e-12)
    assert nums["table"]["rows"][0] == ["equal in bfloat16 (the lower stored precision)", pct(s["unchanged_common"]), ""]
    assert nums["verdict"]["level"] == _verdict_of(s["fisher_reliability"])


@pytest.mark.slow
def test_sweep_headlines(built):
    d = built.get("sweep")["dict"]
    check_headlines("sweep", d)
    assert d["summary"]["fisher_reliability"]["split_half_jaccard"] is not None


@pytest.mark.slow
def test_retention_headlines(built):
    check_headlines("retention", built.get("retention")["dict"])


def test_bound_title_counts_violations_not_a_rounded_fraction():
    """5 violations among a million coordinates is not "100%": the title and the key number say
    the count and the max ratio, from the summary."""
    b = {"bound_violations": 5, "bound_coordinates": 1_000_000, "bound_fraction_holds": 0.999995,
         "bound_max_ratio": 1.423}
    d = {"kind": "train", "summary": {"bound": b},
         "series": [{"name": "bound/|grad|", "step": 0.1, "value": 0.01}]}
    title = dict((n, t) for n, t, _ in titled_figures_for(d))["bound"]
    assert "the bound fails for 5 of 1,000,000 coordinates (max ratio 1.423)" in title and "100%" not in title
    item = {i["label"]: i for i in key_numbers(d)["items"]}["Cauchy-Schwarz bound, first batch"]
    assert item["value"] == "5 violations" and "max ratio 1.423" in item["note"]
    assert "groups" not in item["note"]
    # checked in groups of coordinates (issue 30): the note says so, and how close its quantiles are
    b.update(bound_groups=24, bound_ratio_quantiles={"p50": 0.1234}, bound_ratio_quantile_rel_error=6.1e-5,
             bound_ratio_quantiles_exact=False)
    item = {i["label"]: i for i in key_numbers(d)["items"]}["Cauchy-Schwarz bound, first batch"]
    assert "median |g| / bound 0.1234" in item["note"]
    assert "checked in 24 groups of coordinates to fit the device, its quantiles to ±6.1e-05 relative" in item["note"]


def test_bf16_fisher_states_its_error_against_float32(built):
    """dtype bfloat16 (asked for): the result states its error, and the stated relative L1 is the
    one between the bf16 engine and a float32 run on the same sampled completions."""
    import torch

    from compute.fisher import fisher_from_samples
    from compute.jobs import fisher_run as run_fisher
    from compute.jobs.fisher import FisherSpec
    from compute.lm.causal_lm import load_model

    spec = FisherSpec(model="arith-base", prompts=4, samples=2, max_new_tokens=4, device="cpu",
                      until_reliable=False, dtype="bfloat16")
    with built.env():
        res = run_fisher.run(spec)
        d = Builder.stored(res)
        fp32, _ = load_model("arith-base", device="cpu", dtype="float32")
        bf, tok = load_model("arith-base", device="cpu", dtype="bfloat16")
    s = d["summary"]
    assert s["compute_dtype"] == "bfloat16" and s["accumulate_dtype"] == "float32"
    err = s["precision_error"]
    assert err["rows"] == min(16, s["n_rows"]) and 0 < err["relative_l1"] < 0.5
    # the same first rows, re-sampled deterministically in bf16, scored by the float32 model
    from compute.lm.sampling import sample_completions
    from compute.lm.verifiable_tasks import get_task

    ex = get_task("arithmetic").examples(4, seed=0, split="train", start=0)
    assert next(bf.parameters()).dtype == torch.bfloat16
    roll = sample_completions(bf, tok, [e.prompt for e in ex], 2, 4, 1.0, None, None, 0, 64, prompt_offset=0)
    n = err["rows"]
    rows = (roll.input_ids[:n], roll.attention_mask[:n], roll.completion_mask[:n])
    low = fisher_from_samples(bf, *rows, batch_size=n)
    ref = fisher_from_samples(fp32, *rows, batch_size=n)
    num = sum(float((low[k].double() - ref[k].double()).abs().sum()) for k in ref)
    den = sum(float(ref[k].double().abs().sum()) for k in ref)
    assert err["relative_l1"] == pytest.approx(num / den, rel=1e-6)
    warning = " ".join(key_numbers(d)["warnings"])
    assert "Computed in bfloat16" in warning and fmt(err["relative_l1"]) in warning
    prec = {i["label"]: i for i in key_numbers(d)["items"]}["Precision"]
    assert prec["value"] == "computed in bfloat16, stored in float32" and fmt(err["relative_l1"]) in prec["note"]


# ------------------------------------------------------------------ issue 27: the precision policy


# what reads as bit equality: allowed only where both sides are stored alike, or where the text
# itself says the number compares across precisions (a labelled counter-number, never a headline)
EXACT_WORDS = re.compile(r"exact(ly)?\b[^;:]*\b(unchanged|equal)|unchanged[^;:]*\(exact\)", re.I)
ACROSS = "across precisions"


def shown_texts(d: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, text) of everything a reader of this result is shown as a label: key-number labels
    and notes, the key-number table's title, headers and row labels, every figure's title, trace
    names and colour-bar titles, every table's title and headers."""
    from app.figures.registry import tables_for

    out: list[tuple[str, str]] = []
    nums = key_numbers(d)
    for i in nums["items"]:
        out += [("key number", i["label"]), ("key-number note", i["note"])]
    if nums["table"]:
        t = nums["table"]
        out += [("table", str(t.get("title") or "")), *[("table header", str(h)) for h in t.get("headers", [])],
                *[("table row", str(r[0])) for r in t.get("rows", [])]]
    for name, title, fig in titled_figures_for(parse_result(d)):
        out.append((f"figure {name}", title))
        for tr in fig.data:
            out.append((f"figure {name} trace", str(getattr(tr, "name", "") or "")))
            cb = getattr(tr, "colorbar", None)
            if cb is not None and cb.title is not None and cb.title.text:
                out.append((f"figure {name} colour bar", str(cb.title.text)))
    for title, (headers, _rows) in tables_for(d):
        out += [("table", title), *[("table header", str(h)) for h in headers]]
    return out


@pytest.mark.slow
def test_every_kind_from_a_mixed_precision_pair_never_compares_across_precisions_exactly(built):
    """Issue 27, item 1: fp32 base, bf16 checkpoints (the masked bf16-mixed run). Every kind of
    the registry renders; no headline, figure title, trace, colour bar or table header reads bit
    equality unless the text says it compares across precisions; the kinds that compare the pair
    lead in bfloat16 with >= 90% unchanged; sparse sync is never shown as a saving when it is not."""
    from compute.jobs import registry

    results = {k: built.get(k)["dict"] for k in registry.NAMES}
    for kind, d in results.items():
        for where, text in shown_texts(d):
            if EXACT_WORDS.search(text) and ACROSS not in text:
                raise AssertionError(f"{kind}: {where} compares across precisions exactly: {text!r}")
    # the pair's kinds lead with the comparison in the lower precision
    leads = {"diff": "Weights unchanged, compared in bfloat16",
             "series": "Weights unchanged at the last checkpoint (vs base), compared in bfloat16",
             "train": "Stored weights unchanged, compared in bfloat16"}
    for kind, label in leads.items():
        items = {i["label"]: i["value"] for i in key_numbers(results[kind])["items"]}
        assert label in items, (kind, list(items))
        assert float(items[label].rstrip("%")) >= 90, (kind, items[label])
    s = results["series"]["summary"]
    assert s["stored_dtypes"] == {"base": "float32", "checkpoint": "bfloat16"} and s["comparison_rule"] == "cast"
    assert s["final_update_sparsity"] >= 0.9 > 0.05 > s["final_unchanged_exact"]
    # the bytes: the compared precision's changed coordinates x (int32 index + bf16 value)
    series = json.loads(Path(built.get("series")["job"].files["series"]).read_text())
    for p in series["points"]:
        g = p["vs_prev"]["global"]["all"]
        assert g["sparse_bytes"] == g["changed"] * (4 + 2) and g["dense_bytes"] == g["numel"] * 2
        assert g["sync_bytes"] <= min(g["sparse_bytes"], g["dense_bytes"])
    assert s["sparse_bytes_total"] < s["dense_bytes_total"]  # a 5% mask: sparse is the saving here
    heat = {h["name"]: h for h in results["series"]["heatmaps"]}
    assert heat["base_sparsity_layer_module"]["meta"]["units"] == "unchanged fraction (compared in bfloat16)"
    assert min(v for row in heat["base_sparsity_layer_module"]["z"] for v in row if v is not None) > 0.5
    # the sweep's points (bf16-mixed) lead with the lower stored precision too
    for p in results["sweep"]["summary"]["points"]:
        assert p["comparison_dtype"] == "bfloat16" and p["unchanged_common"] == p["unchanged_exact"]


def test_sync_verdict_never_shows_a_costlier_sparse_sync_as_a_saving():
    """Issue 27: the series' key number when sparse bytes exceed dense (exact equality of an fp32
    base against bf16 checkpoints counted every rounded weight: 6.5e5 sparse vs 2.2e5 dense)."""
    d = {"kind": "series", "summary": {"steps": [1], "sparse_bytes_total": 6.5e5, "dense_bytes_total": 2.2e5,
                                       "sync_bytes_total": 2.2e5}}
    items = {i["label"]: i for i in key_numbers(d)["items"]}
    sync = items["Sparse sync (indices + values) vs dense"]
    assert sync["value"] == "2.95x dense" and "dense is cheaper" in sync["note"]
    assert items["Cheaper of sparse and dense per tensor vs dense"]["value"] == "100%"
    figs = {n: (t, f) for n, t, f in titled_figures_for({**d, "series": [
        {"name": "sync/sparse_bytes", "step": 1, "value": 6.5e5}, {"name": "sync/dense_bytes", "step": 1,
                                                                  "value": 2.2e5}]})}
    title, fig = figs["sync"]
    assert "dense is cheaper" in title
    assert [(tr.name, list(tr.y)) for tr in fig.data] == [("dense (every value)", [2.2e5]),
                                                          ("indices + values of changed", [6.5e5])]


# ------------------------------------------------------------------ issue 27: construction-aware metrics


@pytest.mark.slow
def test_masked_run_headline_aucs_are_the_aucs_inside_the_mask(built):
    """Issue 27, item 2: the run trained inside a 5% Fisher mask (gradients zeroed outside it).
    The diff's, the series' and the train's Fisher metrics are computed over the coordinates inside
    the mask, equal to the AUC computed here by hand on them; over all coordinates the AUC is the
    number the mask makes true, and is only shown labelled."""
    import torch
    from safetensors.torch import load_file

    from compute.sparsity.diff import Checkpoint
    from compute.sparsity.masks import load_mask
    from compute.sparsity.overlap import restrict, roc_auc, score_vs_target

    trained = Path(built.get("train")["model"])
    mask = load_mask(trained / "mask.safetensors")
    fisher = load_file(built._fisher_file())
    base = Checkpoint(built.home / "zoo" / "arith-base")
    # diff: "changed" in the lower stored precision (bf16: tuned is bf16), inside the mask
    tuned = Checkpoint(trained)
    changed = {n: tuned.get(n).bfloat16() != base.get(n).bfloat16() for n in fisher}
    f_in, c_in = restrict(fisher, mask), restrict(changed, mask)
    names = sorted(f_in)
    hand = roc_auc(torch.cat([f_in[n].float() for n in names]), torch.cat([c_in[n] for n in names]))
    d = built.get("diff")["dict"]
    s = d["summary"]
    assert s["construction"]["trained_in_mask"] and s["construction"]["scope"].startswith("inside the mask")
    assert s["changed_auc"] == pytest.approx(hand, abs=1e-12)
    items = {i["label"]: i for i in key_numbers(d)["items"]}
    item = items["Fisher AUC for changed-at-all coordinates (inside the mask: the coordinates free to move)"]
    assert item["value"] == fmt(hand) and "cannot move" in item["note"]
    everywhere = roc_auc(torch.cat([fisher[n].flatten().float() for n in names]),
                         torch.cat([changed[n].flatten() for n in names]))
    assert everywhere > hand  # the frozen 95%: low Fisher and unchanged by construction
    # series: each checkpoint's AUC vs the base, inside the mask, by hand
    series = json.loads(Path(built.get("series")["job"].files["series"]).read_text())
    for p in series["points"]:
        ck = Checkpoint(trained / p["checkpoint"])
        ch = restrict({n: ck.get(n).bfloat16() != base.get(n).bfloat16() for n in fisher}, mask)
        want = roc_auc(torch.cat([f_in[n].float() for n in names]), torch.cat([ch[n] for n in names]))
        got = p["vs_base"]["global"]["all"]["auc"]
        assert (got is None and want != want) or got == pytest.approx(want, abs=1e-12), (p["step"], got, want)
    assert built.get("series")["dict"]["summary"]["construction"]["trained_in_mask"]
    # train: the concentration of the summed g^2 (zero outside the mask) inside the mask
    job = built.get("train")["job"]
    ts = built.get("train")["dict"]["summary"]
    f0 = {n: t.float() for n, t in job.tensors["fisher"].items()}
    frac = ts["concentration"]["fraction"]
    want = score_vs_target(restrict(f0, mask), restrict(job.tensors["grad_sq_sum"], mask), frac)
    assert ts["concentration"]["grad_sq_sum"]["global"]["auc"] == pytest.approx(
        want["global"]["all"]["auc"], abs=1e-12)
    assert ts["concentration"]["scope"].startswith("inside the mask")
    assert ts["concentration_all_coordinates"]["label"]  # kept only labelled
