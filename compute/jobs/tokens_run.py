"""Job `tokens`: the token explorer's computation for one context (compute.studies.tokens)."""

from __future__ import annotations

import math
import time
from typing import Any

from compute.contract.jobresult import Heatmap, JobResult, LayerStat, null_progress
from compute.contract.kinds import Refs
from compute.jobs.tokens import TokensSpec
from compute.lm.naming import layer_index, module_type
from compute.studies.tokens import (
    TokensConfig,
    TokenSet,
    decode_token,
    encode_context,
    token_mechanism,
)


def _labels(tokenizer: Any, ids: list[int]) -> list[str]:
    """Decoded tokens, made unique (plot axes are categorical) by appending #id to repeats."""
    raw = [decode_token(tokenizer, i) for i in ids]
    return [t if raw.count(t) == 1 else f"{t}#{i}" for t, i in zip(raw, ids, strict=True)]


def _rows(tokenizer: Any, ts: TokenSet) -> list[dict[str, Any]]:
    return [
        {"token": decode_token(tokenizer, v), "id": v, "prob": p, "contrib": c, "share": s,
         "deviation": d, "grad_norm": g}
        for v, p, c, s, d, g in zip(ts.ids, ts.probs, ts.contrib, ts.share, ts.deviation,
                                    ts.grad_norm, strict=True)
    ]


def _nan_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run(spec: TokensSpec, progress: Any = null_progress, refs: Refs | None = None) -> JobResult:
    from compute.jobs.artifact_files import resolved_refs
    from compute.lm.causal_lm import load_model, model_info

    t0 = time.perf_counter()
    progress(0.0, "loading the model")
    ref = resolved_refs(spec, refs).get("model")
    assert ref is not None  # the spec requires a model
    model, tokenizer = load_model(ref, device=spec.device, dtype=spec.dtype, progress=progress)
    t_load = time.perf_counter()
    progress(0.02, "forward pass and the top tokens' sensitivities")
    dev = next(model.parameters()).device
    ids = encode_context(tokenizer, spec.context, dev)
    cfg = TokensConfig(
        top_k=spec.top_k, layer=spec.layer, random_k=spec.random_k, low_k=spec.low_k, seed=spec.seed,
        full_vocab_max=spec.full_vocab_max, mass_target=spec.mass_target, max_tokens=spec.max_tokens,
        memory_budget_mb=spec.memory_budget_mb,
    )
    res = token_mechanism(model, ids, cfg, progress=lambda f, m: progress(0.05 + 0.9 * f, m))
    info = model_info(model)
    top_share = sum(res.top.share) if res.fisher_trace > 0 else float("nan")
    summary: dict[str, Any] = {
        "model": spec.model,
        "context": spec.context,
        "n_context_tokens": len(res.context_ids),
        "vocab_size": int(res.probs.numel()),
        "architecture": info.get("architecture"),
        "scope": res.scope,
        "n_params": res.n_params,
        "entropy": res.entropy,
        "top_tokens": _rows(tokenizer, res.top),
        "random_tokens": _rows(tokenizer, res.random),
        "low_tokens": _rows(tokenizer, res.low),
        "top_prob_mass": sum(res.top.probs),
        "top_fisher_share": top_share,
        "fisher_trace": res.fisher_trace,
        "fisher_exact": res.exact,
        "covered_mass": res.covered_mass,
        "covered_tokens": len(res.covered_ids),
        "gbar_norm": res.gbar_norm,
        "mean_cosine_top": _nan_none(res.top.mean_offdiag_cosine()),
        "mean_cosine_random": _nan_none(res.random.mean_offdiag_cosine()),
        "mean_cosine_low": _nan_none(res.low.mean_offdiag_cosine()),
        # trace F vs the counterfactual of mutually orthogonal sensitivities (compute.studies.tokens)
        "similarity": {k: (_nan_none(v) if isinstance(v, float) else v) for k, v in res.similarity.items()},
        "settings": {**res.settings, "layer": spec.layer, "dtype": str(next(model.parameters()).dtype)},
        # issue 18: the precision of the forward/backward (nothing is stored but these rows)
        "compute_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    heatmaps = []
    for which, ts in (("top", res.top), ("random", res.random), ("low", res.low)):
        if len(ts.ids) < 1:
            continue
        lab = _labels(tokenizer, ts.ids)
        heatmaps.append(Heatmap(
            name=f"similarity_{which}", x_labels=lab, y_labels=lab,
            z=[[float(x) for x in row] for row in ts.cosine.tolist()],
            meta={"units": "cosine", "zmin": -1.0, "zmax": 1.0, "token_ids": ts.ids,
                  "probs": ts.probs, "mean_offdiag": _nan_none(ts.mean_offdiag_cosine())},
        ))
    total = res.fisher_trace
    rows = [LayerStat(param=n, module=module_type(n), layer=layer_index(n),
                      values={"mass": m, "share": m / total if total > 0 else 0.0})
            for n, m in res.tensor_fisher.items()]
    progress(1.0, "done")
    # where the time went, by tokens.timing's parts
    summary["seconds_parts"] = {"load": round(t_load - t0, 3), "sensitivities": round(time.perf_counter() - t_load, 3)}
    return JobResult(kind="tokens", summary=summary, layer_stats=rows, heatmaps=heatmaps)
