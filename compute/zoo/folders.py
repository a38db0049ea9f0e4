"""Zoo folders on disk: written atomically, recognised as built, their recorded info read."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

INFO_FILE = "fisherlens.json"


def atomic_folder(out: Path) -> Path:
    """A fresh temporary folder next to `out` (unique, so concurrent builds do not collide)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a zoo folder is read by workers and the web app
    return tmp


def replace_folder(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`, replacing any older folder there."""
    old = out.with_name(f".{out.name}.old-{time.time_ns()}")
    if out.exists():
        out.replace(old)
    tmp.replace(out)
    shutil.rmtree(old, ignore_errors=True)


def save(model: Any, tokenizer: Any, out: Path, info: dict[str, Any]) -> None:
    """Save model, tokenizer and `info` (as INFO_FILE) into `out`, atomically."""
    tmp = atomic_folder(out)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one tiny shard: its bar would only break our own
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        replace_folder(tmp, out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)


def is_built(path: Path) -> bool:
    return (path / INFO_FILE).is_file() and (path / "config.json").is_file()


def read_info(path: Path) -> dict[str, Any]:
    """The recorded info of a built folder ({} when unreadable); n_layers from config.json for
    folders built before it was recorded."""
    if not is_built(path):
        return {}
    try:
        info: dict[str, Any] = json.loads((path / INFO_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if info.get("n_layers") is None:
        try:
            cfg = json.loads((path / "config.json").read_text())
            info["n_layers"] = cfg.get("num_hidden_layers")
        except (OSError, json.JSONDecodeError):
            pass
    return info
