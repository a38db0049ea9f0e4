"""Benchmark tables quoted in the READMEs are exactly what benchmarks/tables.py makes of the
committed JSON (benchmarks/results/*.json)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tables():
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "benchmarks" / "tables.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_tables_match_their_json() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_measured_median_is_in_the_readme_block() -> None:
    tables = _tables()
    data = json.loads((ROOT / "benchmarks" / "results" / "bench_fisher.json").read_text())
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    block = readme.split("<!-- bench:bench_fisher -->")[1].split("<!-- /bench:bench_fisher -->")[0]
    assert block.strip(), "the benchmarks README has no fisher table"
    for row in data["results"]:
        for name, st in row["methods"].items():
            if "seconds" in st:
                assert f"| {name} | {st['seconds']['median']:.3f} [" in block, (row["model"], name)
    # a block is replaced by what the JSON gives, whatever it held before
    stale = "a\n<!-- bench:bench_masked -->\nold numbers\n<!-- /bench:bench_masked -->\nb\n"
    fresh = tables.refresh(stale, {"bench_masked": "new table\n"})
    assert fresh == "a\n<!-- bench:bench_masked -->\nnew table\n<!-- /bench:bench_masked -->\nb\n"
