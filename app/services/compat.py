"""Do references fit together? Read from safetensors headers and tokenizer.json only (no tensor
is read, no torch): a Fisher or mask made for another model, base and tuned of different
architectures, a teacher with another tokenizer."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from compute.contract.shapes import mismatch

Shapes = dict[str, tuple[int, ...]]


# Bounds on what submit reads of a safetensors file the user names (a weight file, a Fisher, a
# mask): its JSON header at most MAX_HEADER_BYTES and MAX_TENSORS tensors (real models: a few
# hundred KB and a few thousand tensors; the attack measured: 94 MB, 1.2 million tensors, which
# held a web process at 1.25 GB and a worker for 24 min).
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_TENSORS = 200_000
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def safetensors_header(path: Path) -> Any:
    """The JSON header of a safetensors file (its first 8 bytes give the header's length), fully
    checked against the file: at most MAX_HEADER_BYTES and MAX_TENSORS, every tensor a known
    dtype with a shape of non-negative integers whose bytes are exactly its data_offsets, the
    tensors tiling the data section without gaps or overlaps and ending at the file's end (what
    the safetensors library itself checks when the worker opens it: a file refused there is
    refused here, at submit). ValueError saying why it cannot be read as one."""
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= MAX_HEADER_BYTES:
                if n > MAX_HEADER_BYTES:
                    raise ValueError(f"has a {n:,}-byte header; at most {MAX_HEADER_BYTES:,} bytes are "
                                     "accepted")
                raise ValueError("is not a safetensors file")
            header = json.loads(fh.read(n))
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("is not a safetensors file (unreadable header)") from None
    if isinstance(header, dict):
        _check_layout(header, size - 8 - n)
    return header


def _check_layout(header: dict[str, Any], data_bytes: int) -> None:
    """ValueError unless the header's tensors tile the `data_bytes` after it (see above)."""
    tensors = [(k, v) for k, v in header.items() if k != "__metadata__"]
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"holds {len(tensors):,} tensors; at most {MAX_TENSORS:,} are accepted")
    spans = []
    for name, entry in tensors:
        shown = name[:60]
        if not isinstance(entry, dict):
            raise ValueError(f"is not a valid safetensors file (tensor {shown!r} has no entry)")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"is not a valid safetensors file (tensor {shown!r}: dtype {str(dtype)[:20]!r})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise ValueError(f"is not a valid safetensors file (tensor {shown!r}: shape {str(shape)[:40]})")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"is not a valid safetensors file (tensor {shown!r}: data_offsets "
                             f"{str(offsets)[:40]})")
        need = math.prod(shape) * DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != need:
            raise ValueError(f"is not a valid safetensors file (tensor {shown!r}: shape {shape} of "
                             f"{dtype} is {need:,} bytes, its offsets span {offsets[1] - offsets[0]:,})")
        spans.append((offsets[0], offsets[1], shown))
    end = 0
    for start, stop, shown in sorted(spans):
        if start != end:
            raise ValueError(f"is not a valid safetensors file (tensor {shown!r} starts at byte "
                             f"{start:,}, not {end:,}: a gap or an overlap)")
        end = stop
    if end != data_bytes:
        raise ValueError(f"is not a valid safetensors file (its tensors end at byte {end:,} of a "
                         f"{data_bytes:,}-byte data section)")


def check_safetensors(path: Path) -> None:
    """ValueError unless `path` is a safetensors file holding at least one tensor."""
    header = safetensors_header(path)
    if not isinstance(header, dict) or not any(k != "__metadata__" for k in header):
        raise ValueError("is a safetensors file with no tensors")


def _weight_files(path: Path) -> list[Path] | None:
    """The safetensors files of a file or a model folder (model.safetensors or the shards of its
    index); None when the index is unreadable."""
    if not path.is_dir():
        return [path]
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            return [path / f for f in shards]
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return [path / "model.safetensors"]


def shapes(path: Path) -> Shapes | None:
    """name -> shape from safetensors headers: a file, or a model folder. None when there are
    no such files."""
    files = _weight_files(path)
    if files is None:
        return None
    out: Shapes = {}
    for f in files:
        try:
            header = safetensors_header(f)
        except ValueError:
            return None
        if not isinstance(header, dict):
            return None
        for k, v in header.items():
            if k != "__metadata__" and isinstance(v, dict):
                out[k] = tuple(v.get("shape") or ())
    return out




def _vocab(folder: Path) -> dict[str, int] | None:
    try:
        tok = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        vocab = {str(p[0]): i for i, p in enumerate(vocab)}
    if not isinstance(vocab, dict):
        return None
    return {**vocab, **{t["content"]: t["id"] for t in tok.get("added_tokens") or []}}


def made_for(path: Path) -> tuple[str | None, str | None]:
    """(label, sha256) of the model a Fisher or mask file records it was made for: a Fisher's
    "fisherlens" metadata (compute.jobs.fisher_run.fisher_metadata), a mask's copy of its Fisher's
    ("fisher_reliability", compute.jobs.mask_run); (None, None) when the file does not say."""
    try:
        header = safetensors_header(path)
    except ValueError:
        return None, None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    for key in ("fisherlens", "fisher_reliability"):
        raw = (meta or {}).get(key)
        try:
            info = json.loads(raw) if isinstance(raw, str) else None
        except ValueError:
            info = None
        if isinstance(info, dict) and info.get("model"):
            sha = info.get("model_sha256")
            return str(info["model"]), str(sha) if sha else None
    return None, None


# (reference field, the model field it must come from, how that model is named)
FIT_PAIRS = (("fisher", "model", "the model"), ("mask", "model", "the model"),
             ("fisher", "base", "the checkpoints"))


def compatibility(found: dict[str, Path], algo: str | None, refs: dict[str, Any] | None = None,
                  allow_other_model: bool = False) -> list[dict[str, str]]:
    """What the worker would refuse about two references together (`found`: field -> local
    model folder or artifact file), as field errors. By field, whatever the kind: a Fisher or
    mask must fit the model it is used with (or the checkpoints it is compared with): the same
    parameter names and shapes (every parameter of the model; a Fisher compared with checkpoints
    may cover a subset of them),
    and (issue 27) unless `allow_other_model`, the same model revision by sha256 when the file
    records the model it was made for and the model was hashed (`refs`: the resolved Refs); a
    tuned checkpoint must fit its base."""
    from compute.contract.provenance import ref_label

    got = {f: shapes(p) for f, p in found.items()}
    errors = []

    def models(field: str, model_field: str) -> str:
        label, _ = made_for(found[field])
        ref = (refs or {}).get(model_field)
        mine = f"{model_field} is {ref_label(ref)!r}" if ref is not None else f"not the {model_field}"
        return f" (the {field} was made for model {label!r}; {mine})" if label else ""

    def check(field: str, model_field: str, whose: str) -> None:
        part, whole = got.get(field), got.get(model_field)
        if part is None or whole is None:
            return
        # with a model: every parameter (a mask or Fisher of arith-base lacks arith-deep-base's
        # extra layers); against checkpoints, a Fisher may cover a subset (compute.sparsity.diff)
        why = mismatch(part, whole, f"the {field}", whose, tied_ok=True, both=model_field == "model")
        if why:
            errors.append({"field": field, "message": why + models(field, model_field)})
            return
        ref = (refs or {}).get(model_field)
        label, sha = made_for(found[field])
        model_sha = getattr(ref, "sha256", None)
        if allow_other_model or not sha or not model_sha or sha == model_sha:
            return
        errors.append({"field": field, "message": (
            f"made for model {label!r} (revision {sha[:12]}), but {model_field} is {ref_label(ref)!r} "
            f"(revision {model_sha[:12]}): the same names and shapes, another model; a {field} must come "
            "from the model it is used with; set allow_other_model to use it anyway")})

    for field, model_field, whose in FIT_PAIRS:
        check(field, model_field, whose)
    base, tuned = got.get("base"), got.get("tuned")
    if base is not None and tuned is not None:
        why = mismatch(base, tuned, "base", "tuned", both=True, tied_ok=True)
        if why:
            errors.append({"field": "tuned", "message": "different architecture: " + why})
    if base is not None and "run_dir" in found:  # every checkpoint of a run folder fits its base
        from compute.contract.modelref import checkpoints

        for c in checkpoints(found["run_dir"]):
            got_c = shapes(c)
            why = ("has no readable safetensors weights" if got_c is None
                   else mismatch(got_c, base, c.name, "the base", both=True, tied_ok=True))
            if why:
                errors.append({"field": "run_dir", "message": f"{c.name}: {why}"})
                break
    if algo == "opd" and "teacher" in found and "model" in found:
        vs, vt = _vocab(found["model"]), _vocab(found["teacher"])
        if vs is not None and vt is not None and vs != vt:
            errors.append({"field": "teacher", "message": "its tokenizer differs from the model's "
                           f"(vocab {len(vt)} vs {len(vs)}); on-policy distillation needs the same "
                           "tokenizer"})
    return errors
