"""fisherlens masks and update sparsity inside TRL's trainers and the HF `Trainer`.

    from compute.integrations.trl import FisherMaskCallback, UpdateSparsityCallback
    trainer = GRPOTrainer(..., callbacks=[FisherMaskCallback("mask.safetensors"),
                                          UpdateSparsityCallback(every=10)])

`FisherMaskCallback(mask)` trains only inside a fisherlens mask (True = trainable). It works with
any trainer built on `transformers.Trainer` (TRL's GRPOTrainer, SFTTrainer, DistillationTrainer,
the plain Trainer), single process. What it guarantees, and how:

- Gradients are masked during backward, before clipping. `Trainer` clips and computes the logged
  `grad_norm` right after the last backward of a step and only then calls `on_pre_optimizer_step`,
  so a callback event is too late. Each partly masked parameter gets a post-accumulate-grad hook
  (`Tensor.register_post_accumulate_grad_hook`) that sets its gradient to +0.0 off the mask as soon
  as autograd has accumulated it (every micro-batch, so gradient accumulation sums masked
  gradients). The logged `grad_norm` and `max_grad_norm` clipping therefore see only the trainable
  coordinates. The gradient is masked again at `on_pre_optimizer_step` (after clipping; it keeps
  the optimizer's moments at exactly 0 off the mask even where something rewrote the gradient).
- Frozen coordinates stay bit-identical whatever the optimizer does. With zero gradients, Adam's
  moments stay 0 and its update there is 0, but decoupled weight decay (torch's AdamW multiplies
  the whole tensor by 1 - lr * wd) moves every weight, and other optimizers may do more. So the
  callback keeps a copy of the frozen coordinates of each partly masked parameter (taken at
  `on_train_begin`, in the parameter's own dtype) and writes them back at `on_optimizer_step`,
  right after `optimizer.step()` and before anything logs, evaluates or saves. The trainable
  coordinates get exactly the optimizer's update (decay included), as without the callback.
  Memory: one copy of the frozen coordinates of partly masked tensors, in their dtype.
- Parameters whose mask is all False (or that are missing from the mask, with the default
  `unmasked="freeze"`) get `requires_grad = False`: no gradient is computed for them, and torch
  optimizers skip a parameter whose `.grad` is None (no update, no weight decay), so they are not
  copied. Given to the trainer's constructor (`callbacks=[...]`), the callback freezes them at
  `on_init_end`, before the optimizer is built, so they are not even in the optimizer; added later
  (`trainer.add_callback`), at `on_train_begin`. At each `on_pre_optimizer_step` their `.grad` is
  set back to None in case other code re-enabled them.
- Names: each mask name is matched to a model parameter exactly, through tied-weight aliases
  (`lm_head.weight` for a tied `model.embed_tokens.weight`), after removing wrapper prefixes
  (`module.`, `_orig_mod.`, `base_model.model.`) on both sides, or with a leading `model.` added
  or removed (a mask of the bare `LlamaModel`). Unmatched names, two mask names of one tied
  parameter with different masks, shape differences, and masks selecting coordinates of a
  parameter the trainer does not train are refused with a ValueError naming them.
- DeepSpeed and FSDP shard or flatten parameters, so per-parameter hooks and copies do not see the
  real tensors: refused at `on_train_begin`. DDP is not tested.

`UpdateSparsityCallback(base=None, every=N)` logs, every N optimizer steps (and at the last), the
update sparsity of the model being trained against `base` (default: the weights at train begin)
into the trainer's own logs (`state.log_history`, and the `logs` dict the callbacks after it see),
in both published conventions, computed by `compute.sparsity.diff.diff_checkpoints` (docs/science.md section 6):
- `update_sparsity/unchanged`: the headline (compute.contract.precision): share of coordinates
  unchanged, exactly when the base and the model are stored alike, else with both cast to the
  lower precision (`update_sparsity/compared_mantissa_bits`: 7 = bfloat16, 23 = float32);
- `update_sparsity/unchanged_bf16`: share of coordinates whose bf16 value did not change;
- `update_sparsity/unchanged_bf16delta_atol_<a>`: share with |tuned_bf16 - base_bf16| <= a, the
  difference taken in bf16 (sparsity_in_rl, arXiv 2505.11711), for each a in `atols`.
Callbacks before it in the trainer's list do not see these keys: the integrations `report_to`
adds (Trainer puts them before user callbacks) and, when it is added with `trainer.add_callback`,
the progress printer. `trainer.state.log_history` and the checkpoints' `trainer_state.json` always
hold them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from compute.sparsity.diff import ATOLS, Checkpoint, diff_checkpoints, open_checkpoint

log = logging.getLogger(__name__)

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
UNMASKED = ("freeze", "train", "error")
SPARSITY_PREFIX = "update_sparsity/"


# ---------------------------------------------------------------------------------------------
# Names: mask (or checkpoint) names -> the model's parameters
# ---------------------------------------------------------------------------------------------


def strip_wrappers(name: str) -> str:
    """`name` without leading wrapper prefixes (DDP `module.`, torch.compile `_orig_mod.`, PEFT
    `base_model.model.`), repeatedly."""
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def _model_prefix_variants(name: str) -> list[str]:
    return [name[len("model."):]] if name.startswith("model.") else ["model." + name]


def match_parameters(
    names: Iterable[str], model: torch.nn.Module, what: str = "mask"
) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """name -> (the model's primary parameter name, the parameter) for every name.

    A name matches a parameter by its exact name or a tied alias, else after removing wrapper
    prefixes on both sides (`strip_wrappers`), else with a leading `model.` added or removed; the
    match must be unique. The primary name is the one `model.named_parameters()` reports (tied
    weights once). ValueError naming the unmatched (or ambiguous) names and a few of the model's.
    """
    primary: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
    params: dict[int, torch.nn.Parameter] = {id(p): p for _, p in model.named_parameters()}
    exact: dict[str, int] = {}
    stripped: dict[str, set[int]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        exact[n] = id(p)
        stripped.setdefault(strip_wrappers(n), set()).add(id(p))
    out: dict[str, tuple[str, torch.nn.Parameter]] = {}
    unmatched: list[str] = []
    ambiguous: list[str] = []
    for name in names:
        if name in exact:
            pid = exact[name]
        else:
            s = strip_wrappers(name)
            found = stripped.get(s, set())
            if not found:
                for v in _model_prefix_variants(s):
                    found = found | stripped.get(v, set())
            if len(found) != 1:
                (unmatched if not found else ambiguous).append(name)
                continue
            pid = next(iter(found))
        out[name] = (primary[pid], params[pid])
    if unmatched or ambiguous:
        parts = []
        if unmatched:
            shown = ", ".join(repr(n) for n in unmatched[:8])
            more = f" and {len(unmatched) - 8} more" if len(unmatched) > 8 else ""
            parts.append(f"{len(unmatched)} name(s) match no parameter of the model: {shown}{more}")
        if ambiguous:
            parts.append("ambiguous name(s) (several parameters): "
                         + ", ".join(repr(n) for n in ambiguous[:8]))
        some = ", ".join(repr(n) for n, _ in list(model.named_parameters())[:3])
        raise ValueError(f"{what}: " + "; ".join(parts) + f" (the model's parameters are named like {some})")
    return out


def as_bool_mask(mask: str | Path | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fisherlens mask file (`fisherlens mask --out`) or a dict of bool / 0-1 tensors -> name ->
    bool tensor (CPU). ValueError for a missing file or a tensor that is not 0/1."""
    if isinstance(mask, (str, Path)):
        from compute.sparsity.masks import load_mask

        return load_mask(mask)
    if not isinstance(mask, Mapping):
        raise ValueError(f"mask: expected a .safetensors path or a dict of tensors, got {type(mask).__name__}")
    out: dict[str, torch.Tensor] = {}
    for n, m in mask.items():
        if not isinstance(m, torch.Tensor):
            raise ValueError(f"mask: entry {n!r} is a {type(m).__name__}, expected a tensor")
        if m.dtype != torch.bool:
            if not bool(((m == 0) | (m == 1)).all()):
                raise ValueError(f"mask: tensor {n!r} has values other than 0 and 1 (dtype {m.dtype})")
            m = m != 0
        out[n] = m.detach().to("cpu")
    return out


def resolve_mask(
    mask: Mapping[str, torch.Tensor], model: torch.nn.Module, unmasked: str = "freeze"
) -> dict[str, torch.Tensor | None]:
    """The model's primary parameter name -> bool mask on the parameter's device, None = train
    densely. Every parameter of the model is a key.

    Mask names are matched with `match_parameters`; two mask names of one tied parameter must hold
    the same mask. Parameters absent from the mask: `unmasked` = 'freeze' (all-False mask),
    'train' (dense) or 'error'. ValueError for a shape difference or a mask that selects nothing.
    """
    if unmasked not in UNMASKED:
        raise ValueError(f"unmasked: got {unmasked!r}; accepted: {', '.join(UNMASKED)}")
    matched = match_parameters(mask, model)
    by_param: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for name, (pname, p) in matched.items():
        m = mask[name]
        if tuple(m.shape) != tuple(p.shape):
            raise ValueError(f"mask: parameter {name!r} has shape {list(m.shape)} in the mask but "
                             f"{list(p.shape)} in the model ({pname!r})")
        if pname in by_param and not torch.equal(by_param[pname], m):
            raise ValueError(f"mask: {source[pname]!r} and {name!r} are the same (tied) parameter "
                             f"{pname!r} of the model but have different masks")
        by_param[pname] = m
        source[pname] = name
    out: dict[str, torch.Tensor | None] = {}
    missing = []
    for pname, p in model.named_parameters():
        if pname in by_param:
            out[pname] = by_param[pname].to(device=p.device, dtype=torch.bool)
        elif unmasked == "train":
            out[pname] = None
        else:
            missing.append(pname)
            out[pname] = torch.zeros(p.shape, dtype=torch.bool, device=p.device)
    if missing and unmasked == "error":
        raise ValueError(f"mask: {len(missing)} parameter(s) of the model are not in the mask: "
                         + ", ".join(repr(n) for n in missing[:8])
                         + " (pass unmasked='freeze' or 'train')")
    if not any(m is None or bool(m.any()) for m in out.values()):
        raise ValueError("mask: selects no coordinate of the model; nothing would train")
    return out


# ---------------------------------------------------------------------------------------------
# FisherMaskCallback
# ---------------------------------------------------------------------------------------------


def _refuse_sharded(args: Any) -> None:
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ValueError("FisherMaskCallback: DeepSpeed and FSDP shard or flatten parameters, so the "
                         "per-parameter gradient masks and frozen copies cannot see them; train "
                         "without deepspeed/fsdp (single process)")


class FisherMaskCallback(TrainerCallback):
    """Train only inside a fisherlens mask (see the module docstring for the guarantees).

    mask: a fisherlens mask `.safetensors` path (`fisherlens mask --out`), a dict name -> bool
    (or 0/1) tensor, True = trainable, or `job:N`: the mask of job N of a fisherlens server
    (`server`, else FISHERLENS_URL, else the server `fisherlens login` saved; `token`, else
    FISHERLENS_TOKEN, else the saved token for the saved server), downloaded through its REST
    API, sha256-verified and cached in `cache_dir` (compute/integrations/server_mask.py); a job
    that is not a succeeded mask (or train) job of yours, or a server that cannot be reached, is
    refused with a ValueError naming the job and the HTTP status. unmasked: what happens to model parameters absent from the
    mask: 'freeze' (default, as fisherlens' own training does), 'train' (dense) or 'error'.

    After training, `summary` holds the counts: trainable / total coordinates, parameters trained
    densely, partly masked and frozen.
    """

    def __init__(self, mask: str | Path | Mapping[str, torch.Tensor], unmasked: str = "freeze", *,
                 server: str | None = None, token: str | None = None,
                 cache_dir: str | Path | None = None):
        if unmasked not in UNMASKED:
            raise ValueError(f"unmasked: got {unmasked!r}; accepted: {', '.join(UNMASKED)}")
        self.source: str | None = None  # 'job:N' of a fisherlens server, when the mask came from one
        if isinstance(mask, str) and mask.strip().startswith("job:"):
            from compute.integrations.server_mask import fetch_mask

            self.source = mask.strip()
            mask = fetch_mask(mask, server=server, token=token, cache_dir=cache_dir)
        self.mask_file = Path(mask) if isinstance(mask, (str, Path)) else None
        self.mask = as_bool_mask(mask)
        self.unmasked = unmasked
        self.summary: dict[str, float] = {}
        self._model: torch.nn.Module | None = None
        self._resolved: dict[str, torch.Tensor | None] = {}
        # (param, frozen bool, frozen values) of partly masked parameters while training
        self._partial: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
        self._frozen: list[torch.nn.Parameter] = []
        self._handles: list[Any] = []

    @property
    def masks(self) -> dict[str, torch.Tensor | None]:
        """The model's parameter name -> bool mask (None: trained densely), once set up."""
        return dict(self._resolved)

    # -- set-up -------------------------------------------------------------------------------
    def _prepare(self, model: torch.nn.Module) -> None:
        """Match names, freeze all-False parameters (requires_grad False); idempotent per model."""
        if self._model is model and self._resolved:
            return
        resolved = resolve_mask(self.mask, model, self.unmasked)
        named = dict(model.named_parameters())
        for pname, m in resolved.items():
            if m is not None and bool(m.any()) and not named[pname].requires_grad:
                raise ValueError(f"mask: selects coordinates of {pname!r}, which the trainer does not "
                                 "train (requires_grad is False); remove them from the mask")
        for pname, m in resolved.items():
            if m is not None and not bool(m.any()):
                named[pname].requires_grad_(False)
        self._model, self._resolved = model, resolved
        total = sum(p.numel() for p in named.values())
        kept = sum(p.numel() if m is None else int(m.sum()) for p, m in
                   ((named[n], m) for n, m in resolved.items()) if p.requires_grad)
        self.summary = {
            "trainable": float(kept), "total": float(total), "density": kept / total if total else 0.0,
            "dense_tensors": float(sum(1 for n, m in resolved.items()
                                       if named[n].requires_grad and (m is None or bool(m.all())))),
            "partial_tensors": float(sum(1 for m in resolved.values()
                                         if m is not None and bool(m.any()) and not bool(m.all()))),
            "frozen_tensors": float(sum(1 for n in resolved if not named[n].requires_grad)),
        }

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if model is not None:  # before the optimizer exists: frozen tensors stay out of it
            self._prepare(model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        _refuse_sharded(args)
        if model is None:
            raise ValueError("FisherMaskCallback: the trainer passed no model to the callback")
        self.remove()
        self._prepare(model)
        named = dict(model.named_parameters())
        self._partial, self._frozen = [], []
        for pname, m in self._resolved.items():
            p = named[pname]
            if m is None or bool(m.all()):
                continue
            if not bool(m.any()):
                self._frozen.append(p)
                continue
            frozen = ~m.to(p.device)
            self._partial.append((p, frozen, p.detach()[frozen].clone()))
            self._handles.append(p.register_post_accumulate_grad_hook(_grad_masker(frozen)))
        log.info("FisherMaskCallback: %d of %d coordinates trainable (%.4g); %d tensors partly "
                 "masked, %d frozen", self.summary["trainable"], self.summary["total"],
                 self.summary["density"], len(self._partial), len(self._frozen))

    # -- every step ---------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        with torch.no_grad():
            for p, frozen, _ in self._partial:
                if p.grad is not None:
                    p.grad.masked_fill_(frozen, 0.0)
            for p in self._frozen:
                p.grad = None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        with torch.no_grad():
            for p, frozen, values in self._partial:
                p.masked_scatter_(frozen, values)  # row-major order, as p[frozen] was read

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove the gradient hooks and drop the frozen copies (also done at train end)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._partial = []
        self._frozen = []


def _grad_masker(frozen: torch.Tensor) -> Any:
    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            p.grad.masked_fill_(frozen, 0.0)  # +0.0 exactly, NaN/inf off the mask too

    return hook


# ---------------------------------------------------------------------------------------------
# UpdateSparsityCallback
# ---------------------------------------------------------------------------------------------


class _CPUView(Mapping[str, torch.Tensor]):
    """name -> the model's parameter, detached and copied to the CPU on access (one at a time)."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter]):
        self._params = params

    def __getitem__(self, name: str) -> torch.Tensor:
        p = self._params[name].detach()
        return p if p.device.type == "cpu" else p.to("cpu")

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def sparsity_logs(base: Any, params: Mapping[str, torch.Tensor], atols: Iterable[float] = (1e-5,)
                  ) -> dict[str, float]:
    """Update sparsity of `params` (name -> tensor, the names of `base`) against `base` (anything
    `compute.sparsity.diff.diff_checkpoints` reads), over all coordinates: the logged keys
    `update_sparsity/unchanged` (the headline policy, compute.contract.precision: exact when the
    base and the model are stored alike, else both cast to the lower precision; a trainer log
    holds numbers, so the precision is `update_sparsity/compared_mantissa_bits`),
    `update_sparsity/unchanged_bf16` and `update_sparsity/unchanged_bf16delta_atol_<a>`."""
    from compute.contract.precision import MANTISSA_BITS

    res = diff_checkpoints(base, params, svd_max_numel=0)
    g = res.groups["global"]["all"]
    low = str(res.precision.get("comparison_dtype"))
    out = {SPARSITY_PREFIX + "unchanged": g["unchanged_common"],
           SPARSITY_PREFIX + "compared_mantissa_bits": float(MANTISSA_BITS.get(low, float("nan"))),
           SPARSITY_PREFIX + "unchanged_bf16": g["unchanged_bf16"]}
    for a in atols:
        out[f"{SPARSITY_PREFIX}unchanged_bf16delta_atol_{a:g}"] = g[f"unchanged_bf16delta_atol_{a:g}"]
    return out


def _open_base(ref: str | Path | Checkpoint) -> Checkpoint:
    """A Checkpoint as is; an existing folder read directly (this runs in the user's own training
    script, so the server's ALLOWED_MODEL_ROOTS do not apply); else a zoo name or a cached hub id."""
    if isinstance(ref, Checkpoint):
        return ref
    if Path(ref).expanduser().is_dir():
        return Checkpoint(Path(ref).expanduser(), "base")
    return open_checkpoint(ref, "base")


class UpdateSparsityCallback(TrainerCallback):
    """Log update sparsity against `base` every `every` optimizer steps and at the last step.

    base: None (the trained model's weights at train begin, copied to the CPU), a zoo name or HF
    folder (its safetensors, as `fisherlens diff` reads them), a `compute.sparsity.diff.Checkpoint` or a state
    dict. Its names are matched to the model's parameters like mask names. atols: the absolute
    tolerances of the bf16-delta convention, each one of compute.sparsity.diff.ATOLS.
    """

    def __init__(self, base: str | Path | Checkpoint | Mapping[str, torch.Tensor] | None = None,
                 every: int = 10, atols: Iterable[float] = (1e-5,)):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every: got {every!r}; accepted: an integer >= 1")
        atols = tuple(float(a) for a in atols)
        bad = [a for a in atols if a not in ATOLS]
        if bad:
            raise ValueError(f"atols: {bad[0]:g} is not computed by compute.sparsity.diff; accepted: "
                             + ", ".join(f"{a:g}" for a in ATOLS))
        self.base_ref = base
        self.every, self.atols = every, atols
        self._base: Any = None
        self._params: dict[str, torch.nn.Parameter] = {}
        self._pending: dict[str, float] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if model is None:
            raise ValueError("UpdateSparsityCallback: the trainer passed no model to the callback")
        if self.base_ref is None:
            self._params = dict(model.named_parameters())
            self._base = {n: p.detach().to("cpu", copy=True) for n, p in self._params.items()}
            return
        if isinstance(self.base_ref, Mapping):
            base: Any = self.base_ref
            names = list(base)
        else:
            base = _open_base(self.base_ref)
            names = base.names()
        matched = match_parameters(names, model, "base")
        for n, (pname, p) in matched.items():
            shape = tuple(base[n].shape) if isinstance(base, Mapping) else base.shape(n)
            if shape != tuple(p.shape):
                raise ValueError(f"base: parameter {n!r} has shape {list(shape)} in the base but "
                                 f"{list(p.shape)} in the model ({pname!r})")
        self._base = base
        self._params = {n: p for n, (_, p) in matched.items()}

    def measure(self) -> dict[str, float]:
        """The sparsity keys for the model's current weights (see `sparsity_logs`)."""
        return sparsity_logs(self._base, _CPUView(self._params), self.atols)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        step = state.global_step
        if step % self.every == 0 or step == state.max_steps:
            self._pending = self.measure()
            control.should_log = True
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kw: Any) -> None:
        if not self._pending or logs is None or any(k.startswith("eval_") for k in logs):
            return
        logs.update(self._pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        self._pending = None
