"""What a job kind is, and what a resolved reference is: the two shapes every layer agrees on.

A job kind is declared once, in `compute/jobs/<kind>.py`, as `KIND = JobKind(...)`; the registry
(`compute.jobs.registry.KINDS`) collects them, and the API, CLI, UI, share page, limits and the
worker iterate it. No other list of kinds exists.

A reference (a spec field naming a model, a Fisher, a mask, ...) is resolved once, at validation,
into a `Ref`: what form it had, where its bytes are, their sha256 and who owns them. The worker
receives the Refs with the job and only re-verifies the sha256; the engine never opens the
database.

Pure: imports pydantic and this package only (the web process imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# What a reference field names. "model": a HF model folder or hub id; "fisher" / "mask" /
# "gradient": a safetensors file of per-parameter tensors; "run_dir": a folder of checkpoint-N.
RefTarget = Literal["model", "fisher", "mask", "gradient", "run_dir"]
# How it was named: a zoo model, a local path inside the allowed roots, a hub id, or the stored
# output of a job (`job:N`).
RefForm = Literal["zoo", "local", "hub", "artifact"]


class Ref(BaseModel):
    """A resolved reference. `given` is what the user wrote (results and titles show it, never a
    server path); `path` is where the worker reads it: an absolute local path for zoo/local, the
    hub id for hub, the artifact store's relative key for artifact."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    field: str
    given: str
    target: RefTarget
    form: RefForm
    path: str
    sha256: str | None = None  # artifact sha256, or the local folder's content revision
    # A local model or run folder: relative name -> sha256 of every file the job reads from it
    # (links followed), checked at submit; the worker reads the folder only if it still holds
    # exactly these files with these bytes (compute.worker.refs). None: not hashed (estimates,
    # the CLI's direct commands), or a ref stored before manifests.
    files: dict[str, str] | None = None
    job_id: int | None = None
    job_kind: str | None = None
    owner_id: int | None = None
    label: str = ""
    # Where this process reads it: set by the resolver (the web's copy, for header checks) and
    # by the worker after `open_store(settings).fetch(path, sha256)`. Never stored with the job.
    local: str | None = None

    def where(self) -> str:
        """The local path (or hub id) the engine reads: `local` once fetched; zoo, local and hub
        refs are readable where they are; an artifact not yet fetched is an error."""
        if self.local:
            return self.local
        if self.form == "artifact":
            raise ValueError(f"{self.field}: {self.given} was not fetched from the artifact store")
        return self.path

    def stored(self) -> dict[str, Any]:
        """What is stored with the job (jobs.refs): everything but this process's `local`."""
        return self.model_dump(mode="json", exclude={"local"})


# field -> its resolved Ref: what a runner receives (`run(spec, progress, refs)`).
Refs = Mapping[str, Ref]


@dataclass(frozen=True)
class KindForm:
    """The kind's sub-tab under New job (app/ui/formtab.py builds it from the spec): the fields
    shown first, in order; every other spec field goes under "More settings"."""

    tab: str  # the sub-tab's label ("Train")
    button: str  # the submit button ("Train")
    main: tuple[str, ...]  # spec fields shown first, in this order
    cost: bool = True  # show the cost-estimate line
    values: Mapping[str, Any] = field(default_factory=dict)  # starting values other than the default


@dataclass(frozen=True)
class TensorView:
    """How the explorer opens a kind's tensors one at a time (app/explore/sources.py): the
    values of each parameter, what they are, how a map of them is pooled, and what a Compare
    of two such results compares.

    artifact      the artifact kind holding the values (a safetensors file), or None
    absolute      show |value| (a signed delta)
    pair          (base field, tuned field): values = |tuned - base| read from the two
                  checkpoints, when the artifact is absent (tuned may be a run folder, whose
                  last checkpoint-<step> is read: `last_checkpoint`)
    value         what a value is, for titles ("Fisher", "|delta|")
    pool          "max" (a large value anywhere in a block shows) or "mean" (a mask: the kept fraction)
    log           log colour scale
    config_field  the model field whose config.json gives the attention heads
    fisher_field  the field naming the Fisher the result was scored against (the overlays)
    k_fields      spec fields holding the top-k percent the result was scored with
    sets          two results of this kind compare as the sets they are (masks), not by rank
    """

    value: str
    artifact: str | None = None
    absolute: bool = False
    pair: tuple[str, str] | None = None
    last_checkpoint: bool = False
    pool: str = "max"
    log: bool = True
    config_field: str | None = None
    fisher_field: str | None = None
    k_fields: tuple[str, ...] = ()
    sets: bool = False


@dataclass(frozen=True)
class JobKind:
    """Everything a job kind is, in one value (declared as `KIND` in compute/jobs/<kind>.py).

    name        the kind's name ("fisher"): the job row's `kind`, the CLI command, the API enum
    title       a short human title ("Fisher", "Checkpoint diff"): share page, result headings
    spec        the pydantic spec class (a compute.contract.specs.Spec)
    contract    its typed result contract (compute.contract.results.Contract)
    runner      "module:function" of `run(spec, progress) -> JobResult`, imported lazily
                (the web process never imports torch); the module may define the child protocol
                (compute/jobs/runners.py)
    cost        spec -> token-passes (app/limits.py multiplies by parameters); required: a kind
                without one is a registry error at import
    order       position in listings (UI tabs, CLI help, API enum): ascending
    refs        spec field -> what it names, for every field that is a reference
    outputs     target -> artifact kind that a `job:N` of this kind provides for a field of that
                target ({"model": "model"}: a train job's trained model folder)
    implied_refs  spec -> {field: reference} the runner loads although the spec leaves the field
                empty (retention's default OPD teacher); validated like given references
    form        the New job sub-tab, or None (no form: e.g. tokens has its own explorer tab)
    cli_args    spec fields taken as positional CLI arguments, in order (diff BASE TUNED)
    example     a small valid spec (tests validate it and price it; docs may show it)
    tensors     how the explorer opens its tensors (TensorView), or None (nothing to open)
    timing      (spec, compute.contract.cost.Sizing) -> {phase: seconds}: the run time on the
                calibrated machine, parts that do not scale with token-passes included (model
                load, decode steps, statistics); None: token-passes x (a + b x params) alone
    memory      (spec, Sizing) -> {part: bytes}: the predicted peak above the process before the
                job (weights, accumulators, temporaries, activations, optimizer state); None:
                unknown (no refusal for memory)
    memory_options  spec changes that lower the peak and keep what the job measures (exact, or
                with a cost its result states: a bf16 Fisher its error against float32), in the
                order they are offered: every estimate prices them by the same `memory` and
                `timing`, and a job refused for memory names those that would fit, with figures
    host_memory (spec, Sizing) -> {part: bytes}: what the job keeps in host memory while `memory`
                counts its device (a GPU: Sizing.device_is_gpu), shown beside the estimate, never
                summed into the peak nor compared with the device's free memory (train's initial
                Fisher, issue 30); None or {}: nothing apart (on a CPU `memory` counts it all)
    """

    name: str
    title: str
    spec: type[Any]
    contract: Any
    runner: str
    cost: Callable[[Any], int]
    order: int = 100
    refs: Mapping[str, RefTarget] = field(default_factory=dict)
    outputs: Mapping[RefTarget, str] = field(default_factory=dict)
    implied_refs: Callable[[Any], Mapping[str, str]] | None = None
    form: KindForm | None = None
    cli_args: tuple[str, ...] = ()
    example: Mapping[str, Any] = field(default_factory=dict)
    tensors: TensorView | None = None
    timing: Callable[[Any, Any], Mapping[str, float]] | None = None
    memory: Callable[[Any, Any], Mapping[str, float]] | None = None
    memory_options: tuple[Mapping[str, Any], ...] = ()
    host_memory: Callable[[Any, Any], Mapping[str, float]] | None = None

    def ref_fields(self, *targets: RefTarget) -> tuple[str, ...]:
        """The reference fields naming one of `targets` (all reference fields when none given)."""
        return tuple(f for f, t in self.refs.items() if not targets or t in targets)
