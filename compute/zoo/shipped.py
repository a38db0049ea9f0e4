"""Shipped zoo weights: the manifest in compute/zoo_weights, sha256 checks, verified install."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from compute.contract.modelref import file_sha256
from compute.zoo.folders import INFO_FILE, atomic_folder, replace_folder

# compute/zoo_weights, next to this package (package data, see pyproject.toml).
WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "zoo_weights"
MANIFEST_FILE = "manifest.json"
# The files of a zoo folder that are shipped (and hashed in the manifest).
SHIPPED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    INFO_FILE,
)


def read_manifest(weights_dir: str | Path | None = None) -> dict[str, Any]:
    """The shipped-weights manifest ({"models": {name: {...}}}); ValueError when missing."""
    path = Path(weights_dir or WEIGHTS_DIR) / MANIFEST_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"zoo: shipped-weights manifest {path} is unreadable ({exc}); reinstall fisherlens "
            "or build with `fisherlens zoo build --from-scratch`"
        ) from None


def install_shipped(
    zoo_dir: str | Path, name: str, weights_dir: str | Path | None = None
) -> dict[str, Any]:
    """Copy the shipped folder of zoo model `name` into `zoo_dir/name`, checking every file
    against the manifest's sha256 (on the copy, so what is installed is what was verified).
    ValueError naming the file on any mismatch; nothing is installed then."""
    weights_dir = Path(weights_dir or WEIGHTS_DIR)
    entry = read_manifest(weights_dir).get("models", {}).get(name)
    if entry is None:
        raise ValueError(
            f"names: no shipped weights for {name!r}; build it with `fisherlens zoo build "
            f"--from-scratch --names {name}`"
        )
    out = Path(zoo_dir).expanduser() / name
    tmp = atomic_folder(out)
    try:
        for fname, want in sorted(entry["files"].items()):
            src = weights_dir / name / fname
            if not src.is_file():
                raise ValueError(f"zoo: shipped file {src} is missing; reinstall fisherlens")
            shutil.copyfile(src, tmp / fname)
            got = file_sha256(tmp / fname)
            if got != want:
                raise ValueError(
                    f"zoo: shipped file {src} has sha256 {got}, the manifest says {want}; "
                    "reinstall fisherlens or build with `fisherlens zoo build --from-scratch`"
                )
        replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return json.loads((out / INFO_FILE).read_text())
