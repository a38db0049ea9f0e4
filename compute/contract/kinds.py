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
class JobKind:
    """Everything a job kind is, in one value.

    name        the kind's name ("fisher"); the job row's `kind`
    title       a short human title ("Fisher", "Checkpoint diff")
    spec        the pydantic spec class (compute.contract.specs)
    contract    its typed result contract (compute.contract.results.Contract)
    runner      "module:function" of `run(spec, progress, refs) -> JobResult`, imported lazily
                (the web process never imports torch); the module may define the child protocol
                (compute.runners)
    refs        spec field -> what it names, for every field that is a reference
    outputs     artifact kinds a `job:N` of this kind provides, by target ({"model": "model"})
    cost        spec -> token-passes (app.limits multiplies by parameters); None = unknown
    extra       anything else a layer needs from the kind (kept small)
    """

    name: str
    title: str
    spec: type[Any]
    contract: Any
    runner: str
    refs: Mapping[str, RefTarget] = field(default_factory=dict)
    outputs: Mapping[str, str] = field(default_factory=dict)
    cost: Callable[[Any], int | None] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
