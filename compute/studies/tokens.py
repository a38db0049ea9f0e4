"""The token mechanism behind low on-policy Fisher (docs/science.md section 5), for one context.

At the next position, with logits z (V,) and probabilities p = softmax(z), let g_v = dz_v/dθ
(over the whole model or one layer's parameters) and gbar = sum_v p_v g_v. Then
d log p(v)/dθ = g_v - gbar and the position's diagonal Fisher is

    F_i = sum_v p_v (g_{v,i} - gbar_i)^2,    trace F = sum_v c_v,  c_v = p_v ||g_v - gbar||^2.

So each token's contribution to the Fisher is c_v, and its share is c_v / trace F. Everything is
computed from the Gram matrix of the vectors {g_v} and gbar when all (rows x parameters) fit in
`memory_budget_mb` ("gram" mode: one backward pass per token). Otherwise ("stream" mode, large
models) the Fisher of the enumerated tokens is accumulated one full gradient at a time (gbar, F
and one gradient in memory) and the Gram matrix of the displayed tokens is accumulated over
parameter chunks that fit the budget (one backward pass per displayed token per chunk). gbar itself is one backward pass of sum_v p_v z_v (p detached), so it is exact for any
vocabulary. The trace is exact when the whole vocabulary is enumerated (V <= full_vocab_max);
otherwise it is summed over the most likely tokens until `mass_target` of the probability is
covered or `max_tokens` tokens are used, and the covered mass is reported.

Contrast sets: `random_k` tokens drawn uniformly (seeded) from the tokens outside the top-k, and
`low_k` least likely tokens.

Similarity as a number (docs/science.md section 5). With the Gram matrix G_uv = <g_u, g_v>,

    trace F      = sum_v p_v G_vv - sum_{u,v} p_u p_v G_uv      (= sum_v p_v G_vv - ||gbar||^2)
    trace F_orth = sum_v p_v G_vv - sum_v p_v^2 G_vv            (were all g_v mutually orthogonal)
    F_orth - F   = sum_{u != v} p_u p_v G_uv                    (= ||gbar||^2 - sum_v p_v^2 G_vv)

so only the diagonal G_vv and ||gbar||^2 are needed: exact when the vocabulary is enumerated.
Otherwise (covered set C) the tail's unknown G_vv >= 0 give bounds, reported as bounds:
F_orth >= sum_C p_v (1 - p_v) G_vv and F_orth - F <= ||gbar||^2 - sum_C p_v^2 G_vv. The top-k
counterfactual (only the top-k tokens' sensitivities made orthogonal) removes
sum_{u != v in top-k} p_u p_v G_uv, exact for any vocabulary from the top-k Gram matrix. A
negative removed part means the tokens' sensitivities point apart and similarity *raises* F.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from compute.contract.jobresult import Progress
from compute.lm.device import default_budget_mb
from compute.lm.naming import layer_index
from compute.studies import tokens_measure as tm


@dataclass(frozen=True)
class TokensConfig:
    top_k: int = field(default=8, metadata={"help": "number of most likely next tokens shown"})
    layer: int | None = field(default=None, metadata={"help": "only this block's parameters (None = whole model)"})
    random_k: int = field(default=8, metadata={"help": "uniformly random contrast tokens (outside the top-k)"})
    low_k: int = field(default=8, metadata={"help": "least likely contrast tokens"})
    seed: int = field(default=0, metadata={"help": "seed of the random contrast tokens"})
    full_vocab_max: int = field(default=1024, metadata={"help": "enumerate the whole vocabulary up to this size"})
    mass_target: float = field(default=0.99, metadata={"help": "probability mass to cover for large vocabularies"})
    max_tokens: int = field(default=256, metadata={"help": "cap on tokens enumerated for the Fisher trace"})
    memory_budget_mb: float | None = field(
        default=None, metadata={"help": "bound on the stored gradient rows per chunk (MiB); None = a "
                                        "quarter of free device memory, as the Fisher engine"})

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k: got {self.top_k}; accepted range: >= 1")
        if self.random_k < 0 or self.low_k < 0:
            raise ValueError("random_k: must be >= 0 (and low_k too)")
        if not 0.0 < self.mass_target <= 1.0:
            raise ValueError(f"mass_target: got {self.mass_target}; accepted range: > 0, <= 1")
        if self.max_tokens < 1 or self.full_vocab_max < 1:
            raise ValueError("max_tokens: must be >= 1 (and full_vocab_max too)")
        if self.memory_budget_mb is not None and not self.memory_budget_mb > 0:
            raise ValueError(f"memory_budget_mb: got {self.memory_budget_mb}; accepted range: > 0")


@dataclass
class TokenSet:
    ids: list[int]
    probs: list[float]
    contrib: list[float]  # c_v = p_v ||g_v - gbar||^2
    share: list[float]  # c_v / trace F (covered)
    deviation: list[float]  # ||g_v - gbar||^2 (the per-token squared score norm)
    grad_norm: list[float]  # ||g_v||
    cosine: torch.Tensor  # (n, n) cosine similarity of g_v

    def mean_offdiag_cosine(self) -> float:
        n = len(self.ids)
        if n < 2:
            return float("nan")
        c = self.cosine.double()
        return float((c.sum() - c.diagonal().sum()) / (n * (n - 1)))


@dataclass
class TokenMechanism:
    context_ids: list[int]
    probs: torch.Tensor  # (V,) float32
    entropy: float
    top: TokenSet
    random: TokenSet
    low: TokenSet
    fisher_trace: float  # sum over covered tokens of c_v
    covered_ids: list[int]
    covered_mass: float
    exact: bool  # whole vocabulary enumerated
    gbar_norm: float
    n_params: int
    scope: str
    tensor_fisher: dict[str, float]  # per-tensor sum_i F_i over the covered tokens
    position_fisher: dict[str, torch.Tensor] | None = None  # per-coordinate F (keep_fisher)
    settings: dict[str, Any] = field(default_factory=dict)
    similarity: dict[str, Any] = field(default_factory=dict)  # counterfactual_orthogonal(...)


def counterfactual_orthogonal(
    p_cov: torch.Tensor, gvv_cov: torch.Tensor, gbar_sq: float, exact: bool, trace_covered: float,
    p_top: torch.Tensor, gram_top: torch.Tensor,
) -> dict[str, Any]:
    """trace F against the counterfactual F_orth where sensitivities are mutually orthogonal
    (module docstring). p_cov, gvv_cov: (C,) probabilities and ||g_v||^2 of the covered tokens
    (the whole vocabulary when `exact`); gbar_sq = ||gbar||^2 (exact); trace_covered = sum_C p_v
    ||g_v - gbar||^2; p_top (k,), gram_top (k, k): the top-k tokens. float64 sums."""
    p, g = p_cov.double(), gvv_cov.double()
    t1 = float((p * g).sum())  # sum_v p_v G_vv
    t2 = float((p * p * g).sum())  # sum_v p_v^2 G_vv
    pt, gt = p_top.double(), gram_top.double()
    sim_top = float(pt @ gt @ pt - (pt * pt * gt.diagonal()).sum())  # sum_{u != v in top} p_u p_v G_uv
    out: dict[str, Any] = {"exact": exact, "gbar_sq": gbar_sq, "sum_p_gvv": t1, "sum_p2_gvv": t2,
                           "top_k": int(pt.numel()), "removed_top": sim_top}
    if exact:
        f, f_orth, removed = t1 - gbar_sq, t1 - t2, gbar_sq - t2
        out.update({
            "trace_f": f, "trace_f_orth": f_orth, "removed": removed,
            "removed_share": removed / f_orth if f_orth > 0 else float("nan"),
            "trace_f_orth_top": f + sim_top,
            "removed_top_share": sim_top / (f + sim_top) if f + sim_top > 0 else float("nan"),
            "what": "exact: the whole vocabulary was enumerated",
        })
    else:
        f_orth_lo, removed_hi = t1 - t2, gbar_sq - t2
        out.update({
            "trace_f": None, "trace_f_lower": trace_covered, "trace_f_orth_lower": f_orth_lo,
            "removed_upper": removed_hi,
            "removed_share_upper": (min(1.0, removed_hi / f_orth_lo) if removed_hi >= 0 and f_orth_lo > 0
                                    else None),
            "trace_f_orth": None, "removed": None, "removed_share": None,
            "trace_f_orth_top": None, "removed_top_share": None,
            "what": "bounds: only the covered tokens were enumerated (tail G_vv unknown, >= 0)",
        })
    return out


def scope_parameters(model: torch.nn.Module, layer: int | None) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters of the whole model, or of transformer block `layer`."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if layer is None:
        return params
    chosen = {n: p for n, p in params.items() if layer_index(n) == layer}
    if not chosen:
        layers = sorted({i for n in params if (i := layer_index(n)) is not None})
        rng = f"{layers[0]}..{layers[-1]}" if layers else "none"
        raise ValueError(f"layer: {layer} is not a block of this model; accepted: {rng}")
    return chosen


def covered_tokens(probs: torch.Tensor, cfg: TokensConfig) -> tuple[list[int], bool]:
    """Token ids enumerated for the Fisher trace (most likely first) and whether that is all of V."""
    V = probs.numel()
    order = torch.sort(probs.double(), descending=True, stable=True).indices
    if V <= cfg.full_vocab_max:
        return order.tolist(), True
    cum = torch.cumsum(probs.double()[order], 0)
    n = int((cum < cfg.mass_target).sum()) + 1  # smallest prefix reaching the target
    n = max(1, min(n, cfg.max_tokens, V))
    return order[:n].tolist(), n == V


def token_sets(probs: torch.Tensor, cfg: TokensConfig) -> tuple[list[int], list[int], list[int]]:
    """(top-k, random contrast, lowest-probability contrast) token ids."""
    V = probs.numel()
    order = torch.sort(probs.double(), descending=True, stable=True).indices.tolist()
    top = order[: min(cfg.top_k, V)]
    rest = order[len(top):]
    g = torch.Generator().manual_seed(int(cfg.seed))
    pick = torch.randperm(len(rest), generator=g)[: min(cfg.random_k, len(rest))].tolist()
    rnd = [rest[i] for i in pick]
    low = order[::-1][: min(cfg.low_k, len(rest))]
    return top, rnd, low


def token_mechanism(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cfg: TokensConfig | None = None,
    keep_fisher: bool = False,
    progress: Progress | None = None,
    method: str = "auto",
) -> TokenMechanism:
    """Sensitivities, cosine similarities and Fisher shares of the next tokens after one context.
    (Over 60 lines only because it fills the TokenMechanism record field by field.)

    input_ids: (1, L) or (L,) long on the model's device. The model is used in eval mode (no
    dropout) and its parameters' .grad are left untouched (autograd.grad is used).
    method: "auto" = the factored path (one vmapped backward over activations for all tokens,
    checked against autograd's gbar; the per-token loop when it does not apply or keep_fisher),
    "loop" = one backward per token (the reference).
    """
    cfg = cfg or TokensConfig()
    if method not in ("auto", "loop"):
        raise ValueError(f"method: got {method!r}; accepted: auto, loop")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"context: expected one non-empty context, got shape {list(input_ids.shape)}")
    params = scope_parameters(model, cfg.layer)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    budget_mb = default_budget_mb(device) if cfg.memory_budget_mb is None else cfg.memory_budget_mb
    budget = int(budget_mb * 2**20)
    n_params = sum(p.numel() for p in params.values())
    probs, covered, exact, (top, rnd, low), m = _measure(
        model, input_ids, params, cfg, budget, keep_fisher, progress, method == "auto")
    probs = probs.cpu()  # the measurements (m) are on the CPU; the model may be on a GPU
    p_cov = probs[covered].to(torch.float64)  # (C,)
    gram, row = m.gram, {v: i for i, v in enumerate(m.rows)}
    gbar_sq = float(gram[-1, -1])
    trace = float((p_cov * m.dev_cov).sum())

    def tset(ids: list[int]) -> TokenSet:
        return _token_set(ids, [row[v] for v in ids], gram, m.deviation, probs, trace)

    ent = float(-(probs * torch.log(probs.clamp_min(1e-300))).sum())
    top_idx = torch.tensor([row[v] for v in top], dtype=torch.long)
    similarity = counterfactual_orthogonal(p_cov, m.gvv_cov, gbar_sq, exact, trace, probs[top],
                                           gram[top_idx][:, top_idx])
    return TokenMechanism(
        context_ids=input_ids[0].tolist(),
        probs=probs.float().cpu(),
        entropy=ent,
        top=tset(top),
        random=tset(rnd),
        low=tset(low),
        fisher_trace=trace,
        covered_ids=covered,
        covered_mass=float(p_cov.sum()),
        exact=exact,
        gbar_norm=math.sqrt(max(gbar_sq, 0.0)),
        n_params=n_params,
        scope="model" if cfg.layer is None else f"layer {cfg.layer}",
        tensor_fisher=m.tensor_fisher,
        position_fisher=m.pos_fisher if keep_fisher else None,
        settings={
            "top_k": cfg.top_k, "random_k": cfg.random_k, "low_k": cfg.low_k, "seed": cfg.seed,
            "full_vocab_max": cfg.full_vocab_max, "mass_target": cfg.mass_target,
            "max_tokens": cfg.max_tokens, "memory_budget_mb": budget_mb,
            "parameter_chunks": m.n_chunks,
            "mode": m.mode,
            **({"fast_path_skipped": m.note} if m.note else {}),
            "random_tokens_from": "uniform over tokens outside the top-k",
        },
        similarity=similarity,
    )


def _measure(model: torch.nn.Module, input_ids: torch.Tensor, params: dict[str, torch.nn.Parameter],
             cfg: TokensConfig, budget: int, keep_fisher: bool, progress: Progress | None,
             factored: bool) -> tuple[torch.Tensor, list[int], bool, tuple, tm.Measured]:
    """probs (V,) float64, covered ids, whether that is the whole vocabulary, (top, random, low)
    ids and the measured gradients (factored path, or the per-token loop with the reason)."""
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            z, calls = tm.forward(model, input_ids, params, factored and not keep_fisher)
            probs = torch.softmax(z.detach().double(), -1)  # (V,) float64
            covered, exact = covered_tokens(probs, cfg)
            sets = token_sets(probs, cfg)
            display = list(dict.fromkeys([*sets[0], *sets[1], *sets[2]]))
            fast = (tm.measure_fast(z, probs, params, calls, covered, display, budget, progress)
                    if calls is not None else "")
            if isinstance(fast, tm.Measured):
                return probs, covered, exact, sets, fast
            m = tm.measure_loop(z, probs, params, covered, display, budget, keep_fisher, progress)
            m.note = fast
            return probs, covered, exact, sets, m
    finally:
        model.train(was_training)


def _token_set(ids: list[int], idx_list: list[int], gram: torch.Tensor, deviation: torch.Tensor,
               probs: torch.Tensor, trace: float) -> TokenSet:
    """The TokenSet of `ids`, whose rows in gram / deviation are idx_list."""
    idx = torch.tensor(idx_list, dtype=torch.long)
    g = gram[idx][:, idx]  # (n, n)
    norms = g.diagonal().clamp_min(0.0).sqrt()
    denom = norms[:, None] * norms[None, :]
    cos = torch.where(denom > 0, g / denom.clamp_min(1e-300), torch.zeros_like(g))
    pr = probs[ids].tolist() if ids else []
    dv = deviation[idx].tolist() if ids else []
    contrib = [p * d for p, d in zip(pr, dv, strict=True)]
    return TokenSet(
        ids=list(ids), probs=pr, contrib=contrib,
        share=[c / trace if trace > 0 else float("nan") for c in contrib],
        deviation=dv, grad_norm=norms.tolist(), cosine=cos.float(),
    )


def encode_context(tokenizer: Any, context: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """(1, L) ids of the context as the tokenizer encodes it (its own special tokens included)."""
    ids = tokenizer(context)["input_ids"]
    if not ids:
        raise ValueError(f"context: {context!r} encodes to no tokens")
    return torch.tensor([ids], dtype=torch.long, device=device)


def decode_token(tokenizer: Any, token_id: int) -> str:
    try:
        return tokenizer.decode([token_id])
    except Exception:  # noqa: BLE001 - some tokenizers fail on special ids; show the raw token
        return str(tokenizer.convert_ids_to_tokens(token_id))
