"""How `compute.studies.tokens` measures the gradients g_v = dz_v/dθ of the next-token logits.

Two paths give the same numbers (tests/unit/test_tokens.py compares them):
- factored (default): `compute.fisher.rowgram`, one vmapped backward over activations for all
  tokens, inner products of per-token gradients from small per-module factors; checked once
  against autograd's gbar (one backward), and skipped (with the reason) when they disagree or
  a module call cannot be factored.
- loop (the reference, and keep_fisher): one backward per token; all rows in one (R, D) matrix
  when it fits the budget ("gram"), else the Fisher streamed one gradient at a time and the Gram
  of the displayed tokens by parameter chunks ("stream").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from compute.contract.jobresult import Progress
from compute.fisher import rowgram as rg
from compute.lm.device import check_tolerance


def next_token_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits (V,) at the last position of one context (1, L), with the graph kept."""
    out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    return out.logits[0, -1]  # (V,)


@dataclass
class Measured:
    """What the two measuring paths (factored, per-token loop) hand back to token_mechanism."""

    gram: torch.Tensor  # (R+1, R+1) float64 Gram of g_v for v in rows, gbar last
    rows: list[int]
    deviation: torch.Tensor  # (R,) ||g_v - gbar||^2 of the rows
    dev_cov: torch.Tensor  # (C,) ||g_v - gbar||^2 of the covered tokens
    gvv_cov: torch.Tensor  # (C,) ||g_v||^2 of the covered tokens
    tensor_fisher: dict[str, float]
    pos_fisher: dict[str, torch.Tensor]
    n_chunks: int
    mode: str
    note: str = ""


def forward(model: torch.nn.Module, input_ids: torch.Tensor, params: dict[str, torch.nn.Parameter],
             record: bool) -> tuple[torch.Tensor, list[rg.Capture] | None]:
    """Logits z (V,) float32 of the next token, and (record=True) every call of a module that
    owns a scoped parameter; None when some call cannot be factored (the loop path is used)."""
    if record:
        try:
            with rg.CallRecorder(model, {id(p): n for n, p in params.items()}) as rec:
                z = next_token_logits(model, input_ids).float()  # (V,)
            return z, rec.calls
        except rg.NotFactorable:
            pass
    return next_token_logits(model, input_ids).float(), None


def measure_loop(z: torch.Tensor, probs: torch.Tensor, params: dict[str, torch.nn.Parameter],
                 covered: list[int], display: list[int], budget: int, keep_fisher: bool,
                 progress: Progress | None) -> Measured:
    """The reference: one backward per token (all rows in one (R, D) matrix when it fits the
    budget, else the Fisher streamed one gradient at a time and the Gram by parameter chunks)."""
    union = list(dict.fromkeys([*covered, *display]))
    p_cov = probs[covered].to(torch.float64)
    gbar_obj = (probs.to(z.dtype).detach() * z).sum()  # its gradient is gbar
    n_params = sum(p.numel() for p in params.values())
    if (len(union) + 1) * n_params * 4 <= budget:
        gram, tensor_fisher, pos_fisher, n_chunks = _gram(
            z, params, union, gbar_obj, budget, progress, fisher=(covered, p_cov),
            keep_fisher=keep_fisher)
        row = {v: i for i, v in enumerate(union)}
        deviation = _deviation(gram)
        cov_idx = torch.tensor([row[v] for v in covered])
        return Measured(gram, union, deviation, deviation[cov_idx], gram.diagonal()[cov_idx],
                        tensor_fisher, pos_fisher, n_chunks, "gram")
    dev_cov, gvv_cov, tensor_fisher, pos_fisher = _stream_fisher(
        z, params, covered, p_cov, gbar_obj, keep_fisher, progress)
    gram, _, _, n_chunks = _gram(z, params, display, gbar_obj, budget, progress)
    return Measured(gram, display, _deviation(gram), dev_cov, gvv_cov, tensor_fisher, pos_fisher,
                    n_chunks, "stream")


def measure_fast(z: torch.Tensor, probs: torch.Tensor, params: dict[str, torch.nn.Parameter],
                 calls: list[rg.Capture], covered: list[int], display: list[int], budget: int,
                 progress: Progress | None) -> Measured | str:
    """The factored path (compute.fisher.rowgram): rows e_v (display), p (gbar) and e_v - p
    (every covered or displayed token, so ||g_v - gbar||^2 has no cancellation). Returns why it
    does not apply instead (the caller takes the loop), e.g. when autograd's gbar disagrees."""
    V, dev_rows = z.numel(), list(dict.fromkeys([*covered, *display]))
    p = probs.to(z.device, torch.float32)
    u_s = torch.zeros(len(display) + 1, V, device=z.device)
    u_s[torch.arange(len(display)), torch.tensor(display, dtype=torch.long)] = 1.0
    u_s[-1] = p
    try:
        fac_s = rg.row_factors(z, calls, u_s)
        fac_g = {n: [(a[-1:], b[-1:]) for a, b in f] for n, f in fac_s.items()}
        gram = torch.zeros(len(display) + 1, len(display) + 1, dtype=torch.float64)
        gbar_t = {}
        for name, f in fac_s.items():
            g_t = rg.inner_products(f, f).cpu()
            gram += g_t
            gbar_t[name] = float(g_t[-1, -1])
        if progress:
            progress(0.0, "checking the factored gradients against autograd")
        note = _check_gbar(z, probs, params, gbar_t)
        if note:
            return note
        if progress:
            progress(0.0, f"token sensitivities 0/{len(dev_rows)}")
        per_row = 16 * sum(c.output.numel() for c in calls)  # cotangents and factors, float32
        step = max(1, budget // max(1, per_row))
        n = len(dev_rows)
        dev, cross = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        w = torch.tensor([float(probs[v]) for v in dev_rows], dtype=torch.float64)
        w[len(covered):] = 0.0  # display-only tokens are not in the trace
        tensor_fisher = dict.fromkeys(params, 0.0)
        for rows in rg.row_chunks(n, step):
            u = -p.expand(rows.stop - rows.start, V).clone()
            u[torch.arange(u.shape[0]), torch.tensor(dev_rows[rows], dtype=torch.long)] += 1.0
            for name, f in rg.row_factors(z, calls, u).items():
                d_t = rg.inner_products(f).cpu()
                dev[rows] += d_t
                cross[rows] += rg.inner_products(f, fac_g[name])[:, 0].cpu()
                tensor_fisher[name] += float((w[rows] * d_t).sum())
            if progress:
                progress(rows.stop / n, f"token sensitivities {rows.stop}/{n}")
    except rg.NotFactorable as exc:
        return f"not factorable: {exc}"
    nc, at = len(covered), {v: i for i, v in enumerate(dev_rows)}
    gvv = dev[:nc] + 2 * cross[:nc] + float(gram[-1, -1])  # ||(g_v - gbar) + gbar||^2
    return Measured(gram, display, dev[[at[v] for v in display]], dev[:nc], gvv, tensor_fisher,
                     {}, 1, "factored")


def _check_gbar(z: torch.Tensor, probs: torch.Tensor, params: dict[str, torch.nn.Parameter],
                fast: dict[str, float]) -> str:
    """'' when the factored ||gbar_T||^2 of every tensor equals autograd's (one backward), else
    the tensors that differ: a call the factors do not model (fused kernel, weight transform)."""
    names = list(params)
    grads = torch.autograd.grad((probs.to(z.dtype).detach() * z).sum(),
                                [params[n] for n in names], retain_graph=True, allow_unused=True)
    ref = {n: float(g.double().square().sum()) if g is not None else 0.0
           for n, g in zip(names, grads, strict=True)}
    tol = check_tolerance([p.dtype for p in params.values()])
    floor = 1e-6 * sum(ref.values()) / max(1, len(ref))
    bad = [n for n in names if abs(fast.get(n, 0.0) - ref[n]) > tol * abs(ref[n]) + floor]
    return f"factored gbar differs from autograd on {', '.join(bad[:4])}" if bad else ""


def _deviation(gram: torch.Tensor) -> torch.Tensor:
    """||g_v - gbar||^2 for each row of a Gram matrix whose last row/column is gbar. (R-1,)"""
    R = gram.shape[0]
    diag = gram.diagonal()[:-1]  # ||g_v||^2
    cross = gram[:-1, R - 1]  # g_v . gbar
    return (diag - 2 * cross + gram[R - 1, R - 1]).clamp_min(0.0)


def _gram(
    z: torch.Tensor, params: dict[str, torch.nn.Parameter], rows: list[int], gbar_obj: torch.Tensor,
    budget: int, progress: Progress | None,
    fisher: tuple[list[int], torch.Tensor] | None = None, keep_fisher: bool = False,
) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor], int]:
    """Gram matrix (R+1, R+1) float64 of g_v for v in rows plus gbar (last), accumulated over
    parameter chunks of at most `budget` bytes of (R+1, D_chunk) float32. With fisher=(ids, p),
    ids a subset of rows, also the per-coordinate sum_v p_v (g_v - gbar)^2 per tensor."""
    R = len(rows) + 1
    pos = {v: i for i, v in enumerate(rows)}
    gram = torch.zeros(R, R, dtype=torch.float64)
    tensor_fisher: dict[str, float] = {}
    pos_fisher: dict[str, torch.Tensor] = {}
    chunks = _chunks(params, R, budget)
    steps, done = len(chunks) * R, 0
    for chunk in chunks:
        inputs = [params[n] for n in chunk]
        sizes = [p.numel() for p in inputs]
        J = torch.empty(R, sum(sizes), dtype=torch.float32, device=z.device)  # (R, D_chunk)
        for v in rows:
            gs = torch.autograd.grad(z[v], inputs, retain_graph=True, allow_unused=True)
            J[pos[v]] = _flat(gs, inputs)
            done += 1
            if progress and done % 8 == 0:
                progress(done / steps, f"token sensitivities {done}/{steps}")
        J[R - 1] = _flat(torch.autograd.grad(gbar_obj, inputs, retain_graph=True, allow_unused=True), inputs)
        done += 1
        gram += (J.double() @ J.double().T).cpu()
        if fisher is not None:
            ids, p_ids = fisher
            idx = torch.tensor([pos[v] for v in ids], device=J.device)
            dev = J[idx].double() - J[R - 1].double()  # (C, D_chunk)
            f = (p_ids.to(J.device)[:, None] * dev.pow(2)).sum(0)  # (D_chunk,)
            for n, part, p in zip(chunk, torch.split(f, sizes), inputs, strict=True):
                tensor_fisher[n] = float(part.sum())
                if keep_fisher:
                    pos_fisher[n] = part.float().view_as(p).cpu()
            del dev, f
        del J
    return gram, tensor_fisher, pos_fisher, len(chunks)


def _stream_fisher(
    z: torch.Tensor, params: dict[str, torch.nn.Parameter], covered: list[int], p_cov: torch.Tensor,
    gbar_obj: torch.Tensor, keep_fisher: bool, progress: Progress | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
    """||g_v - gbar||^2 and ||g_v||^2 for each covered token (C,) and F = sum_v p_v (g_v - gbar)^2
    per tensor, one full gradient at a time (gbar, F and one gradient in memory)."""
    names = list(params)
    inputs = [params[n] for n in names]
    gbar = [g.float() if g is not None else torch.zeros_like(p, dtype=torch.float32)
            for g, p in zip(torch.autograd.grad(gbar_obj, inputs, retain_graph=True, allow_unused=True),
                            inputs, strict=True)]
    F = [torch.zeros_like(g) for g in gbar]
    dev_cov = torch.zeros(len(covered), dtype=torch.float64)
    gvv_cov = torch.zeros(len(covered), dtype=torch.float64)
    for j, v in enumerate(covered):
        gs = torch.autograd.grad(z[v], inputs, retain_graph=True, allow_unused=True)
        pv = float(p_cov[j])
        total, norm = 0.0, 0.0
        for t, (g, gb) in enumerate(zip(gs, gbar, strict=True)):
            gv = g.float() if g is not None else torch.zeros_like(gb)
            d = gv - gb
            total += float(d.double().pow(2).sum())
            norm += float(gv.double().pow(2).sum())
            F[t].add_(d.pow(2), alpha=pv)
        dev_cov[j] = total
        gvv_cov[j] = norm
        if progress and j % 8 == 0:
            progress(j / max(1, len(covered)), f"Fisher over covered tokens {j}/{len(covered)}")
    tensor_fisher = {n: float(f.double().sum()) for n, f in zip(names, F, strict=True)}
    pos_fisher = {n: f.cpu() for n, f in zip(names, F, strict=True)} if keep_fisher else {}
    return dev_cov, gvv_cov, tensor_fisher, pos_fisher


def _flat(grads: tuple[torch.Tensor | None, ...], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate gradients (None = zero, e.g. a parameter the logit does not depend on)."""
    return torch.cat([
        (g if g is not None else torch.zeros_like(p)).reshape(-1).float()
        for g, p in zip(grads, inputs, strict=True)
    ])


def _chunks(params: Mapping[str, torch.Tensor], rows: int, budget_bytes: int) -> list[list[str]]:
    """Groups of parameter names whose (rows x numel) float32 matrix fits the budget."""
    out: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for n, p in params.items():
        b = rows * p.numel() * 4
        if cur and size + b > budget_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    if cur:
        out.append(cur)
    return out
