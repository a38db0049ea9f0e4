"""The one validation path of the API, the UI and `fisherlens submit`: what the spec alone
cannot say (model and artifact references, layer ranges, jsonl task files). Messages name the
field and echo the user's input, never a server path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.services import refs as resolver
from app.services.compat import compatibility
from compute.contract.kinds import Ref
from compute.contract.modelref import inside_roots
from compute.contract.specs import SpecError
from compute.jobs.registry import parse_spec

Errors = list[dict[str, str]]


def validate(
    settings: Any, kind: str, data: dict[str, Any], user: Any = None
) -> tuple[Any, list[str], dict[str, Ref]]:
    """(spec, revision parts, resolved refs) or SpecError naming each bad field: the one
    validation path of the API, the UI and `fisherlens submit` (the direct CLI commands call
    check_spec with local=True). `user` is the caller (ownership of `job:N`). Nothing that
    passes is refused by a worker for its input."""
    spec = parse_spec(kind, data)  # types, ranges, cross-field rules, task names and options
    parts, refs = check_spec(settings, kind, spec, user=user)
    return spec, parts, refs


def check_spec(
    settings: Any, kind: str, spec: Any, *, local: bool = False, user: Any = None
) -> tuple[list[str], dict[str, Ref]]:
    """What the spec alone cannot say: every reference resolved once by app.services.refs
    (zoo, allowed folders, hub ids, job:N with its owner, files; see there), layer ranges
    against the model's config.json, whether the references fit together (safetensors
    headers: app.services.compat) and jsonl: task files (inside the allowed roots, every line
    valid). `local` (the CLI's direct commands, run as the user): any readable file or folder.
    Returns (revision parts, {field: Ref}); SpecError otherwise. Messages name the field and
    echo the user's input, never a server path."""
    refs, errors = resolver.resolve_values(settings, resolver.spec_values(kind, spec), user,
                                           local=local, hash_models=not local)
    layer = getattr(spec, "layer", None)
    if "model" in refs and layer is not None:
        try:
            _check_layer(refs["model"], int(layer))
        except ValueError as exc:
            errors.append(resolver.field_error("layer", exc))
    if not errors:
        found = {f: Path(r.local) for f, r in refs.items() if r.local}
        errors += compatibility(found, getattr(spec, "algo", None), refs,
                                allow_other_model=bool(getattr(spec, "allow_other_model", False)))
    task = getattr(spec, "task", None)
    if isinstance(task, str) and task.startswith("jsonl:"):
        try:
            _check_jsonl(settings, task, local)
        except ValueError as exc:
            errors.append(resolver.field_error("task", exc))
    if errors:
        raise SpecError(errors)
    return resolver.revision_parts(refs), refs


def _check_layer(model: Ref, layer: int) -> None:
    """ValueError when `layer` is not a block of the model (read from its config.json as JSON,
    no torch, no weights; hub ids are not checked)."""
    if not model.local:
        return
    folder, ref = Path(model.local), model.given
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise ValueError(f"model: {ref!r} has no readable config.json") from None
    if not isinstance(cfg, dict):
        return
    n = next(
        (cfg[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(cfg.get(k), int)),
        None,
    )
    if n is not None and not 0 <= layer < n:
        raise ValueError(f"layer: got {layer}; accepted range: >= 0, <= {n - 1} (the model has {n} blocks)")


def _check_jsonl(settings: Any, task: str, local: bool) -> None:
    from compute.lm.verifiable_tasks import get_task

    raw = task[len("jsonl:"):].partition("?")[0]
    path = Path(raw).expanduser()
    if not local and not path.is_absolute():
        raise ValueError(f"jsonl file {raw!r}: give an absolute path")
    try:
        resolved = path.resolve()
        if not local and not inside_roots(resolved, list(settings.model_roots)):
            raise ValueError(
                f"jsonl file {raw!r} is outside the allowed roots; the operator can add folders "
                "with ALLOWED_MODEL_ROOTS=/a:/b"
            )
        if not resolved.is_file():
            raise ValueError(f"jsonl file {raw!r} does not exist")
        get_task(task).examples(1, split="train")  # parses every line; needs a train example
    except OSError as exc:
        raise ValueError(f"jsonl file {raw[:80]!r} cannot be read ({exc.strerror})") from None

