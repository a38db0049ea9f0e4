"""What a zoo folder holds: one row per zoo name and real model, built or not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compute.contract.modelref import REAL_MODEL_NAMES, ZOO_NAMES
from compute.zoo.folders import read_info
from compute.zoo.real import REAL_MODELS


def zoo_list(zoo_dir: str | Path) -> list[dict[str, Any]]:
    """One row per zoo name, then per real model: name, params, n_layers, accuracy, note, path,
    built (bool), how (the command that builds it)."""
    zoo_dir = Path(zoo_dir).expanduser()
    rows = []
    for name in (*ZOO_NAMES, *REAL_MODEL_NAMES):
        path = zoo_dir / name
        info = read_info(path)
        real = REAL_MODELS.get(name)
        rows.append(
            {
                "name": name,
                "params": info.get("params"),
                "n_layers": info.get("n_layers"),
                "accuracy": info.get("accuracy"),
                "note": info.get("note") or (real.note if real else ""),
                "path": str(path),
                "built": bool(info),
                "how": f"fisherlens zoo add {name}" if real else "fisherlens zoo build",
            }
        )
    return rows
