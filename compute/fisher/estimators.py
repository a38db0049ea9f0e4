"""The estimators on top of the per-sample hooks: per-row (`sequence`) and per-token (`token`)
squared gradients, the `batch` baseline, and the checks that keep the engine exact or refusing.

Before the first pass on a model the engine verifies it once: on two rows, the per-row gradients
the hooks form must add up to autograd's batch gradient for every parameter (this catches a
transform between a parameter and its module's output, or a parameter used twice). On the first
pass of every call it compares the parameters autograd reaches from the loss with those the hooks
covered. Either failure raises `UnsupportedModel` naming the parameters; nothing is zero-filled.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from compute.contract.cost import CHECK_ROWS, ENGINE_SHAPE_GUESS, Sizing, config_shape
from compute.contract.cost import rows_per_forward as cost_rows_per_forward
from compute.fisher.accumulate import Accumulator, Store
from compute.fisher.hooks import (
    PerSampleHooks,
    UnsupportedModel,
    check_coverage,
    graph_parameters,
)
from compute.lm.device import accumulator_dtype, check_tolerance, default_budget_mb, model_device
from compute.lm.head import target_logprob
from compute.lm.sampling import position_ids_from_mask
from compute.runtime.memory import release_freed_memory

# models whose per-row gradients were verified against autograd (see module doc)
_VERIFIED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
_VERIFY_ROWS = CHECK_ROWS  # the estimate counts the same rows (compute.contract.cost)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter for every named parameter that requires grad (tied weights once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()  # no dropout: the Fisher of the deterministic model
    try:
        yield
    finally:
        model.train(was_training)


def _row_loss(model: nn.Module, ids: torch.Tensor, am: torch.Tensor, cm: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
    """sum_n scale_n * sum_t cm[n,t] log p(ids[n,t] | ids[n,<t])  (scalar, float32)."""
    logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am),
                   use_cache=False).logits  # (B, L, V)
    lp = logits[:, :-1].float() if logits.dtype != torch.float64 else logits[:, :-1]
    # log p of the targets without a log_softmax output or its gradient kept: the logits and
    # one gradient built in place (compute.lm.head.target_logprob; issue 30: two (B, L, V)
    # tensors fewer in each pass)
    tok = target_logprob(lp, ids[:, 1:])  # (B, L-1)
    w = cm[:, 1:].to(tok.dtype) * scale.to(tok.dtype).unsqueeze(1)  # (B, L-1)
    return (tok * w).sum()


def _auto_batch(model: nn.Module, L: int, budget_bytes: int, shared_numel: int) -> int:
    """Rows per forward so that activations + per-row buffers of shared params fit
    ROW_BUDGET_SHARE of the budget (the rest: the squares, the hooks' gradients, the allocator):
    the cost model's own function (compute.contract.cost.rows_per_forward) on the model's shape,
    a size its config lacks guessed large (ENGINE_SHAPE_GUESS: that only sizes batches smaller)."""
    shape = {**ENGINE_SHAPE_GUESS, **config_shape(getattr(model, "config", None))}
    z = Sizing(params=0, shared=shared_numel, layers=shape["layers"], hidden=shape["hidden"],
               vocab=shape["vocab"], intermediate=shape.get("intermediate", 0))
    return cost_rows_per_forward(z, L, budget_bytes)


def _shared_numel(model: nn.Module, params: dict[str, nn.Parameter]) -> int:
    """Total size of parameters owned by more than one module (tied weights) that need a per-row
    buffer: not a tied embedding + output head (one nn.Embedding, one nn.Linear), which the
    engine sums without one (compute.fisher.accumulate, issue 30)."""
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(m)

    def buffered(p: nn.Parameter) -> bool:
        mods = owners.get(id(p), [])
        if len(mods) <= 1:
            return False
        kinds = sorted("embedding" if isinstance(m, nn.Embedding) else "linear" if type(m) is nn.Linear
                       else "other" for m in mods)
        return kinds != ["embedding", "linear"]

    return sum(p.numel() for p in params.values() if buffered(p))


def rows_per_forward(model: nn.Module, length: int, memory_budget_mb: int | None) -> int:
    """The engine's own choice of rows per forward at row length `length` within the budget
    (the automatic batch of fisher_sums): activations + per-row buffers of tied weights."""
    params = trainable_parameters(model)
    dev = next(model.parameters()).device
    return _auto_batch(model, length, budget_bytes(memory_budget_mb, dev), _shared_numel(model, params))


def budget_bytes(memory_budget_mb: int | None, device: torch.device) -> int:
    """The memory budget in bytes; None = a quarter of the device's free memory (see device)."""
    mb = default_budget_mb(device) if memory_budget_mb is None else int(memory_budget_mb)
    return mb * 2**20


def right_padded(ids: torch.Tensor, am: torch.Tensor,
                 cm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows repacked so every row's real tokens come first (left or right padding in).

    Positions count real tokens only (position_ids_from_mask), so repacking changes no log-prob.
    ValueError when completion_mask counts a padding position."""
    amb = am.bool()
    if bool((cm.bool() & ~amb).any()):
        raise ValueError("completion_mask: counts padding positions (attention_mask 0); "
                         "counted tokens must be real tokens")
    if bool((amb[:, 1:] <= amb[:, :-1]).all()):
        return ids, am, cm  # already right-padded
    perm = (~amb).to(torch.uint8).argsort(dim=1, stable=True)  # real tokens first, order kept
    return ids.gather(1, perm), am.gather(1, perm), cm.gather(1, perm)


def _chunks(ids, am, cm, w, grp, bs: int, device: torch.device):
    """(ids, am, cm, scale, groups) per forward batch, trailing all-pad columns dropped."""
    for s in range(0, ids.shape[0], bs):
        a = am[s : s + bs].to(device)
        width = max(1, int(a.sum(1).max()))  # right padding: drop all-pad columns
        yield (ids[s : s + bs, :width].to(device), a[:, :width],
               cm[s : s + bs, :width].to(device).bool(),
               w[s : s + bs].sqrt().to(device),  # squared grads scale by w_n
               grp[s : s + bs].to(device))


def _one_pass(model: nn.Module, store: Store, params: dict[str, nn.Parameter], chunk: tuple,
              budget: int, coverage: bool) -> None:
    """Forward + activation backward over one batch, squares added into `store`."""
    ids, am, cm, scale, grp = chunk
    acc = Accumulator(store, grp, budget)
    names = {id(p): n for n, p in params.items()}
    with PerSampleHooks(model, acc, names, ids.shape[0], ids.shape[1]) as hooks:
        loss = _row_loss(model, ids, am, cm, scale)
        if not loss.requires_grad:
            return
        inputs = list(hooks.leaves) or list(params.values())
        _backward(hooks, acc, loss, params, coverage,
                  lambda: torch.autograd.grad(loss, inputs, allow_unused=True))


def _backward(hooks: PerSampleHooks, acc: Accumulator, loss: torch.Tensor,
              params: dict[str, nn.Parameter], coverage: bool, run: Callable[[], object]) -> None:
    """Run a pass's backward (`run`) with the hooks attached: an error a hook raised comes out as
    itself (autograd wraps it); then the pass's last uses are flushed and, on a first pass, the
    parameters the loss reaches are checked against those the hooks covered."""
    reached = graph_parameters(loss) if coverage else None
    try:
        run()
    except Exception:
        if hooks.error is not None:
            raise hooks.error from None
        raise
    acc.finish_pass()
    if reached is not None:
        check_coverage(hooks, reached, params)


def _check_pass(model: nn.Module, store: Store, params: dict[str, nn.Parameter], names: list[str],
                chunk: tuple, budget: int, coverage: bool, norms: dict[str, float],
                diffs: dict[str, float]) -> bool:
    """One forward + backward that gives both sides of the self-check for the parameters `names`:
    the engine's per-row gradients (summed into store.check) and autograd's own gradient, which
    a post-accumulate-grad hook subtracts from the same tensor as it arrives and frees (its L1
    norm into `norms`). The embedding lookups stay in the graph (detach_lookups=False), so
    autograd reaches every use. store.check[name] ends as engine - autograd, whichever side came
    first (issue 30: two passes, autograd's and the engine's, were 1.6 s of a 6 s job at 100M).
    Where nothing of the engine's is still held back for the parameter when autograd's arrives
    (every use's per-row gradients came before it, as the backward runs), the difference's L1 norm
    goes into `diffs` at once and the tensor is dropped: the check holds the tensors of the
    parameters in flight, not 4 bytes/param (which had made it the job's peak at 100M: the check
    alone 8.5-8.6 -> 5.4-5.5 bytes/param above the weights, benchmarks/check_peak.py). What is left in store.check after
    the pass is compared by the caller; a late part for a parameter compared early adds its own
    L1 norm (an upper bound of the difference's: it can refuse, never wrongly accept).
    The model's own .grad are put back. False when the loss does not depend on the parameters."""
    ids, am, cm, scale, grp = chunk
    acc = Accumulator(store, grp, budget)
    check = store.check
    assert check is not None
    group = [params[n] for n in names]
    kept = [p.grad for p in group]

    def fold(p: torch.Tensor, n: str) -> None:
        g, p.grad = p.grad, None
        if g is None:
            return
        _, norms[n] = _l1_diff(None, g, g.numel())
        c = check.get(n)
        if c is None:
            c = check[n] = g.to(store.dtype).neg_()  # ours now (p.grad released): negated in place
        else:
            c.sub_(g.to(store.dtype))
        del g
        if not acc.pending(n):
            diffs[n], _ = _l1_diff(check.pop(n), None, c.numel())

    handles = []
    try:
        for n, p in zip(names, group, strict=True):
            p.grad = None
            norms[n] = 0.0
            handles.append(p.register_post_accumulate_grad_hook(lambda p, n=n: fold(p, n)))
        with PerSampleHooks(model, acc, {id(p): n for n, p in params.items()}, ids.shape[0],
                            ids.shape[1], detach_lookups=False) as hooks:
            loss = _row_loss(model, ids, am, cm, scale)
            if not loss.requires_grad:
                return False
            _backward(hooks, acc, loss, params, coverage, lambda: loss.backward(inputs=group))
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(group, kept, strict=True):
            p.grad = g
    return True


def _check_positions(model: nn.Module, ids: torch.Tensor, am: torch.Tensor, tol: float) -> None:
    """The engine feeds position_ids counted over real tokens (0, 1, ...): the model's own forward
    of an unpadded row must give the same logits. Models that derive positions from the token ids
    (RoBERTa's padding_idx offset) compute another function under the engine: refuse them."""
    w = int(am[0].sum())
    row, ram = ids[:1, :w], am[:1, :w]
    with torch.no_grad():
        own = model(input_ids=row, use_cache=False).logits.float()
        ours = model(input_ids=row, attention_mask=ram, position_ids=position_ids_from_mask(ram),
                     use_cache=False).logits.float()
    diff = float((own - ours).abs().max())
    if diff > tol * max(float(own.abs().max()), 1e-6):
        raise UnsupportedModel(
            f"model: {type(model).__name__} is not supported by the exact per-sample engine: its own "
            "forward of an unpadded row differs from the forward with position_ids 0, 1, ... "
            f"(max |logit difference| {diff:.3g}): it derives positions its own way (e.g. from the "
            "token ids and a padding index), so the engine would compute another model's Fisher")


def check_groups(params: dict[str, nn.Parameter], budget: int) -> list[list[str]]:
    """The parameters in consecutive groups whose self-check fits the temporaries budget: the
    check holds, per parameter, one tensor in the accumulator's dtype: the engine's per-row
    gradients summed, less autograd's gradient, which arrives a parameter at a time (_check_pass).
    One group when the whole model fits (issue 30: the check of all parameters at once was 8
    bytes/param above the weights, more than the accumulators; then two tensors per parameter in
    groups: two groups at 100M, each an autograd and an engine pass, where one pass serves)."""
    acc_bytes = accumulator_dtype([p.dtype for p in params.values()]).itemsize
    groups: list[list[str]] = [[]]
    size = 0
    for n, p in params.items():
        need = p.numel() * max(acc_bytes, p.element_size())
        if groups[-1] and size + need > budget:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += need
    return groups


def _verify(model: nn.Module, params: dict[str, nn.Parameter], chunk: tuple, budget: int,
            check_bytes: int | None = None) -> None:
    """Once per model: the engine's inputs give the model's own outputs (positions), and per-row
    gradients of a few rows must add up to autograd's gradient. Parameters are checked in groups
    whose check fits check_bytes (check_groups: the room of the accumulators not yet allocated,
    else the budget; one group for a float32 model, whose 4 bytes/param fit the accumulators' 6),
    each in one forward and backward within the budget (_check_pass)."""
    ids, am, cm, scale, grp = (t[:_VERIFY_ROWS] for t in chunk)
    dtypes = [p.dtype for p in params.values()]
    _check_positions(model, ids, am, check_tolerance(dtypes))
    diffs: dict[str, float] = {}
    norms: dict[str, float] = {}
    acc_dtype = accumulator_dtype(dtypes)
    for gi, names in enumerate(check_groups(params, check_bytes or budget)):
        store = Store({n: p.shape for n, p in params.items()}, 1, acc_dtype,
                      ids.device, check=True, squares=False, check_names=set(names))
        if not _check_pass(model, store, params, names, (ids, am, cm, scale, torch.zeros_like(grp)),
                           budget, coverage=gi == 0, norms=norms, diffs=diffs):
            return
        assert store.check is not None
        for n in names:
            got = store.check.pop(n, None)  # engine - autograd, where not compared in the pass
            if got is not None or n not in diffs:
                diffs[n] = diffs.get(n, 0.0) + _l1_diff(got, None, params[n].numel())[0]
            del got
    floor = 1e-6 * sum(norms.values()) / max(1, len(params))
    rel = {n: d / max(norms[n], 1e-300) for n, d in diffs.items() if d > floor}
    bad = {n: e for n, e in rel.items() if e > check_tolerance(dtypes)}
    if bad:
        shown = ", ".join(f"{n} ({e:.3g})" for n, e in list(bad.items())[:6])
        raise UnsupportedModel(
            f"model: {type(model).__name__} is not supported by the exact per-sample engine: the "
            f"per-sample gradients of {shown} do not add up to autograd's batch gradient "
            "(relative L1 error in brackets): a transform the engine does not model sits between "
            "these parameters and their module's output, or they are used outside it; refusing "
            "rather than returning a wrong Fisher")
    _VERIFIED[model] = True


def _l1_diff(got: torch.Tensor | None, ref: torch.Tensor | None, numel: int,
             chunk: int = 1 << 20) -> tuple[float, float]:
    """(||got - ref||_1, ||ref||_1) over chunks of `chunk` values (a missing side is zero), each
    chunk summed in its own float dtype (half precision in float32) and the chunks in float64: no
    float64 copy of a whole tensor (a 262k x 640 embedding would be 1.3 GB), and a float32
    chunk's sum is within 1e-6 of the float64 one, far inside the check's tolerance (issue 30: the
    float64 sums were a third of a 100M model's self-check)."""
    g = None if got is None else got.detach().reshape(-1)
    r = None if ref is None else ref.detach().reshape(-1)

    def l1(t: torch.Tensor) -> float:
        wide = t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32
        return float(t.abs().sum(dtype=wide))

    diff = norm = 0.0
    for o in range(0, numel, chunk):
        gc = None if g is None else g[o:o + chunk]
        rc = None if r is None else r[o:o + chunk]
        if rc is not None:
            norm += l1(rc)
        d = gc if rc is None else (-rc if gc is None else gc - rc.to(gc.dtype))
        if d is not None:
            diff += l1(d)
    return diff, norm


def per_sample_square_sums(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, row_weights: torch.Tensor | None = None,
    groups: torch.Tensor | None = None, n_groups: int = 1, memory_budget_mb: int | None = None,
    batch_size: int | None = None, into: Store | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """sum over rows n in group k of w_n * (d/dθ sum_t cm[n,t] log p(y_{n,t}))^2, per group.

    into: a Store (n_groups groups) that keeps accumulating across calls; the sums are then added
    to it and {} is returned (the caller finishes it once: one set of accumulators, issue 30).
    progress(done, total): called after each forward batch (rows done, rows in all).

    input_ids, attention_mask, completion_mask: (N, L), left or right padded; row_weights (N,)
    >= 0 (default 1); groups (N,) long in [0, n_groups). Rows are sorted by real length so each
    forward batch drops its padding. Returns name -> (n_groups, *param.shape) float32 (float64
    for a float64 model) on the model's device, for every parameter that requires grad.
    Raises UnsupportedModel when the model's per-sample gradients cannot be made exact."""
    device = model_device(model)
    params = trainable_parameters(model)
    N = input_ids.shape[0]
    w = torch.ones(N) if row_weights is None else row_weights.detach().double().cpu()
    if (w < 0).any():
        raise ValueError("weights: must be >= 0")
    grp = torch.zeros(N, dtype=torch.long) if groups is None else groups.long().cpu()
    ids, am, cm = right_padded(input_ids.cpu(), attention_mask.cpu(), completion_mask.cpu())
    order = am.sum(1).argsort(descending=True, stable=True)  # longest first: less padding
    ids, am, cm, w, grp = ids[order], am[order], cm[order], w[order], grp[order]
    budget = budget_bytes(memory_budget_mb, device)
    bs = batch_size or _auto_batch(model, ids.shape[1], budget, _shared_numel(model, params))
    store = into if into is not None else new_store(model, n_groups)
    with _eval(model), _refusing(model):
        for i, chunk in enumerate(_chunks(ids, am, cm, w, grp, bs, device)):
            if i == 0 and model not in _VERIFIED:
                # before the first squares reach the store (its sums are allocated lazily), so
                # the check's gradients and the accumulators are never alive together (issue 30)
                t_check = time.perf_counter()
                # the accumulators are not allocated yet: the check's sums and gradients may use
                # their room (the budget stays for the check pass's own temporaries), so the
                # job's peak stays within accumulators + budget with fewer check groups
                room = store.unallocated_bytes() if not store.sums else 0
                _verify(model, params, chunk, budget, check_bytes=max(room, budget))
                store.check_seconds += time.perf_counter() - t_check
                release_freed_memory()  # the check's sums, before the accumulators take their room
            _one_pass(model, store, params, chunk, budget, coverage=i == 0)
            if progress is not None:
                progress(min(N, (i + 1) * bs), N)
            # what the pass freed goes back to the system before the next one maps its own: glibc
            # kept 110 MiB of a 50M model's passes between them, which put the token Fisher's
            # passes above accumulators + budget (benchmarks/pass_peaks.py; issue 30). A no-op
            # off glibc; the device's own allocator is not touched.
            release_freed_memory()
    return store.finish() if into is None else {}


def new_store(model: nn.Module, n_groups: int) -> Store:
    """Empty accumulators (allocated as the first squares arrive) for every trainable parameter."""
    params = trainable_parameters(model)
    return Store({n: p.shape for n, p in params.items()}, n_groups,
                 accumulator_dtype([p.dtype for p in params.values()]), model_device(model))


@contextlib.contextmanager
def _refusing(model: nn.Module) -> Iterator[None]:
    """Any other error while the engine runs the model (a forward that breaks on padded batched
    rows, an in-place op on a hooked leaf, an autograd.Function vmap cannot see through) becomes
    UnsupportedModel naming the model and the cause: refuse, never a stray exception (issue 18).
    Out-of-memory and cancellation pass through unchanged: they are not about the model."""
    from compute.contract.jobresult import JobCancelled

    try:
        yield
    except (UnsupportedModel, torch.OutOfMemoryError, JobCancelled):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised as the refusal it is
        arch = getattr(getattr(model, "config", None), "architectures", None)
        name = arch[0] if arch else type(model).__name__
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise UnsupportedModel(
            f"model: {name} is not supported by the exact per-sample engine: its forward or "
            f"backward fails on the engine's batched, padded rows with hooks attached "
            f"({type(exc).__name__}: {first})") from exc


def expand_tokens(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per counted token: the row truncated after that token, completion_mask one-hot.

    Returns (ids, attention_mask, completion_mask, source_row), each with n_tokens rows. Causal
    attention means later tokens never change an earlier log-prob, so truncation is exact."""
    rows, cols = completion_mask.bool().nonzero(as_tuple=True)  # (n_tokens,)
    ids = input_ids[rows]
    am = attention_mask[rows].clone()
    ar = torch.arange(input_ids.shape[1], device=input_ids.device)
    am = am * (ar.unsqueeze(0) <= cols.unsqueeze(1)).to(am.dtype)
    cm = ar.unsqueeze(0) == cols.unsqueeze(1)
    ids = torch.where(am.bool(), ids, ids[:, :1])  # pad value is irrelevant (masked, never counted)
    return ids, am, cm, rows


def fisher_sums(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, estimator: str = "sequence", weights: torch.Tensor | None = None,
    groups: torch.Tensor | None = None, n_groups: int = 1, memory_budget_mb: int | None = None,
    batch_size: int | None = None, into: Store | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-group sums of squared per-sample gradients and per-group denominators (n_groups,).
    into: accumulate into this Store instead (sums returned as {}; see per_sample_square_sums).

    sequence: sample = row, denominator = sum of row weights; token: sample = counted token,
    denominator = sum over tokens of their row's weight."""
    N = input_ids.shape[0]
    w = torch.ones(N, dtype=torch.float64) if weights is None else weights.double().cpu()
    if w.shape != (N,):
        raise ValueError(f"weights: shape {tuple(w.shape)}; need ({N},), one per row")
    grp = torch.zeros(N, dtype=torch.long) if groups is None else groups.long().cpu()
    if estimator == "sequence":
        sums = per_sample_square_sums(model, input_ids, attention_mask, completion_mask, w, grp,
                                      n_groups, memory_budget_mb, batch_size, into, progress)
        denom = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, grp, w)
        return sums, denom
    if estimator == "token":
        ids, am, cm, src = expand_tokens(input_ids.cpu(), attention_mask.cpu(),
                                         completion_mask.cpu())
        sums = per_sample_square_sums(model, ids, am, cm, w[src], grp[src], n_groups,
                                      memory_budget_mb, batch_size, into, progress)
        denom = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, grp[src], w[src])
        return sums, denom
    raise ValueError(f"estimator: got {estimator!r}; accepted: sequence, token")


def fisher_from_samples(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, estimator: str = "sequence", weights: torch.Tensor | None = None,
    memory_budget_mb: int | None = None, batch_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Exact diagonal Fisher of the given samples: name -> float32 CPU tensor of the param shape.

    input_ids, attention_mask, completion_mask: (N, L), left or right padded; attention_mask
    marks real tokens, completion_mask the tokens whose log-probs count.
    estimator="sequence": sum_n w_n g_n^2 / sum_n w_n with g_n = d/dθ sum_t log p(y_{n,t}).
      Cost ≈ one forward + one backward over the batch (see benchmarks/README.md).
    estimator="token": mean over counted tokens (weighted by their row's weight) of
      (d/dθ log p(y_{n,t}))^2. Each token needs its own gradient, so it expands the N rows into
      n_tokens truncated rows: cost ≈ (n_tokens / N) x (mean truncated length / L) x sequence,
      about T_completion x the sequence cost for completions of T tokens.
    weights: (N,) >= 0 per-row weights (None = 1). memory_budget_mb bounds the per-row gradient
    temporaries and the automatic forward batch (batch_size=None); None = a quarter of free
    device memory. Raises UnsupportedModel for models it cannot make exact.
    """
    sums, denom = fisher_sums(model, input_ids, attention_mask, completion_mask, estimator,
                              weights, None, 1, memory_budget_mb, batch_size)
    d = float(denom.sum())
    if d <= 0:
        raise ValueError("completion_mask: no counted tokens (or all weights are zero)")
    out = {}
    for n in list(sums):
        s = sums.pop(n)
        out[n] = (s[0] if s.shape[0] == 1 else s.sum(0)).div_(d).float().cpu()  # in place
    return out


def batch_fisher(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, batch_size: int = 8,
) -> dict[str, torch.Tensor]:
    """Child-Tuning style: sum over minibatches of (d/dθ mean_n NLL_n)^2, NLL_n = -sum_t log p.

    Cheap and biased (cross-sample terms survive); a baseline, not the model Fisher.

    Each parameter's gradient is squared into its sum as soon as autograd has accumulated it (a
    post-accumulate-grad hook) and freed there (issue 30): one gradient alive at a time, not the
    whole set (4 bytes/param) that torch.autograd.grad returns at once. The model's own .grad
    are put back afterwards."""
    device = model_device(model)
    params = trainable_parameters(model)
    out = {n: torch.zeros(p.shape, dtype=torch.float32, device=device) for n, p in params.items()}
    kept = {n: p.grad for n, p in params.items()}
    seen: dict[int, str] = {}
    handles = []
    for n, p in params.items():
        if id(p) in seen:  # a tied parameter listed twice: one hook, one sum
            continue
        seen[id(p)] = n

        def fold(p: torch.Tensor, n: str = n) -> None:
            if p.grad is not None:
                out[n].addcmul_(p.grad.float(), p.grad.float())
                p.grad = None

        p.grad = None
        handles.append(p.register_post_accumulate_grad_hook(fold))
    N = input_ids.shape[0]
    try:
        with _eval(model):
            for s in range(0, N, batch_size):
                ids = input_ids[s : s + batch_size].to(device)
                am = attention_mask[s : s + batch_size].to(device)
                cm = completion_mask[s : s + batch_size].to(device).bool()
                scale = torch.full((ids.shape[0],), -1.0 / ids.shape[0], device=device)
                _row_loss(model, ids, am, cm, scale).backward()
    finally:
        for h in handles:
            h.remove()
        for n, p in params.items():
            p.grad = kept[n]
    return {n: t.cpu() for n, t in out.items()}
