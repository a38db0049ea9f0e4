"""The README's tables are generated from committed result files (benchmarks/readme_tables.py):
this fails when a table in README.md differs from what its source file generates."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load() -> object:
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["readme_tables"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_readme_tables_match_their_source_files() -> None:
    rt = load()
    text = (ROOT / "README.md").read_text()
    found = rt.markers(text)
    assert "retention_default" in found, "README.md lost the retention_default table markers"
    assert rt.stale(text) == [], "run: python benchmarks/readme_tables.py"
    for rel in rt.FILES:  # result notes quoting the same tables
        if (ROOT / rel).is_file():
            assert rt.stale((ROOT / rel).read_text()) == [], f"{rel}: run python benchmarks/readme_tables.py"


def test_every_source_records_its_command_and_model_hashes() -> None:
    rt = load()
    for name, table in rt.TABLES.items():
        data = json.loads(table.path().read_text())
        prov = data.get("provenance") or (data.get("meta") or {}).get("provenance")
        if prov is None:
            continue  # benchmark files record their own meta; their renderer states it
        # a fisherlens command, or the benchmark script that ran fisherlens commands
        assert prov.get("command", "").startswith(("fisherlens ", "python benchmarks/")), name
        assert any(m.get("sha256") for m in prov.get("models", {}).values()), name
        assert "sha256" in table.generate(), name


def _toy(tmp_path: Path) -> tuple[object, dict, str]:
    rt = load()
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"rows": [["a", 1.5]], "provenance": {
        "command": "fisherlens x --y 1", "git": {"commit": "0123456789abcdef"},
        "models": {"m": {"sha256": {"model.safetensors": "f" * 64}}}}}))
    tables = {"toy": rt.TableSource("toy", "r.json", lambda d: "| k | v |\n|---|---|\n"
                                    + "".join(f"| {k} | {v} |\n" for k, v in d["rows"]))}
    text = "intro\n<!-- table:toy -->\nold\n<!-- /table -->\nend\n"
    return rt, tables, text


def test_update_writes_between_markers_and_check_detects_a_changed_number(tmp_path: Path) -> None:
    rt, tables, text = _toy(tmp_path)
    assert rt.stale(text, tmp_path, tables) == ["toy"]
    new = rt.update(text, tmp_path, tables)
    assert new.startswith("intro\n<!-- table:toy -->\n| k | v |\n|---|---|\n| a | 1.5 |\n")
    assert "made by `fisherlens x --y 1`" in new and "commit 0123456789" in new
    assert "model.safetensors sha256 ffffffffffff" in new and new.endswith("<!-- /table -->\nend\n")
    assert rt.stale(new, tmp_path, tables) == []
    assert rt.update(new, tmp_path, tables) == new  # idempotent
    assert rt.stale(new.replace("| a | 1.5 |", "| a | 1.6 |"), tmp_path, tables) == ["toy"]
    (tmp_path / "r.json").write_text(json.dumps({"rows": [["a", 2.0]]}))  # the source moved on
    assert rt.stale(new, tmp_path, tables) == ["toy"]


def test_unknown_marker_is_an_error(tmp_path: Path) -> None:
    rt, tables, _ = _toy(tmp_path)
    with pytest.raises(KeyError, match="nope"):
        rt.update("<!-- table:nope -->\nx\n<!-- /table -->\n", tmp_path, tables)
    with pytest.raises(ValueError, match="twice"):
        rt.markers("<!-- table:toy -->\n<!-- /table -->\n<!-- table:toy -->\n<!-- /table -->\n")
