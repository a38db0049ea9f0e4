"""Every device and dtype decision of the compute side, in one place.

- `resolve_device`: "auto" -> Settings.fisherlens_device (FISHERLENS_DEVICE), else cuda when available, else cpu.
- `resolve_dtype`: "auto" -> bfloat16 on a CUDA device that supports it, else float32. The
  Fisher job does not default to "auto": FisherSpec.dtype is float32 on every device (a bf16
  forward/backward moves a real model's Fisher by a few % relative L1, up to ~20% on single
  tensors), and a half-precision Fisher, when asked for, reports its error against float32
  (compute.jobs.fisher_run.precision_error). Training, tokens and retention keep "auto".
- `wide`: the dtype per-sample maths runs in (float32 for half-precision tensors; float64 stays).
- `accumulator_dtype`: the dtype Fisher sums are kept in (float64 for float64 models, else
  float32, whatever the model dtype).
- `check_tolerance`: how far a float computation may drift from autograd in the model's dtype.
- `free_memory_bytes` / `default_budget_mb`: what a job may still take on its device (CUDA:
  `torch.cuda.mem_get_info`; CPU: available RAM; capped by MAX_JOB_MEMORY_MB less what the
  process holds) and the engines' automatic memory budget from it, by the rules the estimate
  uses (compute.contract.cost.job_room_bytes, default_budget_mb).

Nothing here imports transformers; the module is cheap to import.
"""

from __future__ import annotations

import os

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
HALF = (torch.bfloat16, torch.float16)


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """ "auto"/None: Settings.fisherlens_device (FISHERLENS_DEVICE) if set, else cuda if
    available, else cpu."""
    if isinstance(device, torch.device):
        return device
    if device in (None, "", "auto"):
        from compute.contract.settings import get_settings

        device = get_settings().fisherlens_device or None
        if device in (None, "auto"):
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device: {device!r} is not a device; accepted: auto, cpu, cuda, cuda:N"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available; use auto or cpu")
    return dev


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device | str | None = None
) -> torch.dtype:
    """ "auto"/None: bfloat16 on a CUDA device that supports it, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        dev = resolve_device(device) if not isinstance(device, torch.device) else device
        if dev.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(
            f"dtype: {dtype!r} is not accepted; accepted: auto, float32, bfloat16, float16"
        )
    return DTYPES[dtype]


def wide(t: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision (and float32) tensors; float64 stays float64."""
    return t if t.dtype == torch.float64 else t.float()


def accumulator_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """float64 sums when any parameter is float64 (exact reference runs), else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def check_tolerance(dtypes: list[torch.dtype]) -> float:
    """Relative L1 tolerance between two float computations of one gradient in these dtypes.

    Half precision: the engine's per-row sums (float32 from bf16 activations) and autograd's
    bf16 gradient differ by up to ~1.3% (tiny models, L=60); structural errors the engine's check
    looks for are >= ~30% (a missing scale, a second use, a zero), so 0.1 separates them."""
    if any(d in HALF for d in dtypes):
        return 0.1
    return 1e-6 if all(d == torch.float64 for d in dtypes) else 2e-3


def free_memory_bytes(device: torch.device) -> int:
    """What a job may still take on `device` now: its free memory (CUDA free memory, or available
    RAM on CPU), and no more than MAX_JOB_MEMORY_MB less what this process holds there
    (compute.contract.cost.job_room_bytes: the cap the submit checked the estimate against holds
    in the job too; before, the job sized its budget and GRPO's bound groups to the device alone)."""
    from compute.contract.cost import job_room_bytes
    from compute.contract.settings import get_settings

    cap = get_settings().max_job_memory_mb
    free = device_free_bytes(device)
    if cap is None:
        return free
    return int(job_room_bytes(free, cap, _held_bytes(device)))


def device_free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:  # Linux: MemAvailable counts reclaimable page cache, unlike SC_AVPHYS_PAGES
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def _held_bytes(device: torch.device) -> int:
    """What this process holds on `device`: CUDA memory torch has reserved there, or the
    process's resident memory (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device))
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def default_budget_mb(device: torch.device) -> int:
    """The engines' automatic memory budget: compute.contract.cost.default_budget_mb (a quarter,
    256 MiB .. 32 GiB) of what a job may still take on `device` (free_memory_bytes)."""
    from compute.contract.cost import default_budget_mb as of_free

    return of_free(free_memory_bytes(device))


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model's parameters are on (CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
