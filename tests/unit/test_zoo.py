"""The zoo: built models load with plain transformers, accuracies are recorded and in range."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from app.cli import main
from compute.modelref import ZOO_NAMES, model_revision, resolve_model
from compute.models import greedy_accuracy, load_model
from compute.tasks import get_task
from compute.zoo import (
    INFO_FILE,
    ZooRecipe,
    build_model,
    build_tokenizer,
    build_zoo,
    sft_tensors,
    zoo_list,
)

pytestmark = pytest.mark.slow  # the session fixture builds the zoo once (about a minute or two)


@pytest.fixture
def home(zoo_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    return zoo_home


def _info(home: Path, name: str) -> dict:
    return json.loads((home / "zoo" / name / INFO_FILE).read_text())


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_model_loads_with_auto_classes(home: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = home / "zoo" / name
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / f).is_file()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert tok.pad_token == "<pad>" and tok.eos_token == "<eos>" and tok.bos_token == "<bos>"
    ids = tok("12+34=")["input_ids"]
    assert len(ids) == 6 and tok.decode(ids) == "12+34="
    assert tok.decode(tok("46")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "46"
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_accuracies_recorded_in_range_and_reproducible(home: Path) -> None:
    base, teacher = _info(home, "arith-base"), _info(home, "arith-teacher")
    assert 0.10 <= base["accuracy"] <= 0.40, base["accuracy"]
    assert teacher["accuracy"] >= 0.70, teacher["accuracy"]
    assert teacher["accuracy"] >= base["accuracy"] + 0.3
    for info in (base, teacher):
        assert info["accuracy_split"] == "test" and info["accuracy_decoding"] == "greedy"
        assert info["params"] > 0 and info["train_steps"] > 0 and info["seed"] == 0
        assert info["build_seconds"] > 0
    # the recorded number is what greedy decoding on the test split gives now
    model, tok = load_model("arith-base", device="cpu", dtype="float32")
    measured = greedy_accuracy(model, tok, "arithmetic", n=base["accuracy_prompts"], split="test")
    assert measured == pytest.approx(base["accuracy"], abs=1e-9)
    assert model.num_parameters() == base["params"]


def test_modelref_on_zoo(home: Path) -> None:
    assert resolve_model("arith-teacher") == str(home.resolve() / "zoo" / "arith-teacher")
    rev = model_revision("arith-base")
    assert len(rev) == 64 and rev == model_revision("arith-base")
    assert rev != model_revision("arith-teacher")


def test_zoo_list_rows(home: Path, tmp_path: Path) -> None:
    rows = zoo_list(home / "zoo")
    assert [r["name"] for r in rows] == list(ZOO_NAMES)
    assert all(r["built"] and r["params"] > 0 and 0 <= r["accuracy"] <= 1 for r in rows)
    empty = zoo_list(tmp_path / "nothing")
    assert not any(r["built"] for r in empty) and all(r["accuracy"] is None for r in empty)


def test_cli_list_and_build_skips_built_models(home: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["zoo", "list"])
    assert res.exit_code == 0, res.output
    for name in ZOO_NAMES:
        assert name in res.output
    acc = _info(home, "arith-base")["accuracy"]
    assert f"{acc:.1%}" in res.output
    before = (home / "zoo" / "arith-base" / "model.safetensors").stat().st_mtime_ns
    res = runner.invoke(main, ["zoo", "build"])
    assert res.exit_code == 0, res.output
    assert "arith-base:" in res.output and "arith-teacher:" in res.output and "params" in res.output
    assert (home / "zoo" / "arith-base" / "model.safetensors").stat().st_mtime_ns == before
    res = runner.invoke(main, ["zoo", "build", "--names", "arith-base,bogus"])
    assert res.exit_code == 2 and "--names: unknown zoo model 'bogus'" in res.output


def test_build_zoo_rejects_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="names: unknown zoo model 'x'"):
        build_zoo(tmp_path, names=["x"])


def test_build_is_deterministic_in_its_inputs() -> None:
    # cheap stand-in for building twice: tokenizer, initial weights and SFT data are seed-fixed
    t1, t2 = build_tokenizer(), build_tokenizer()
    assert t1.get_vocab() == t2.get_vocab()
    recipe = ZooRecipe()
    a, b, c = build_model(t1, recipe, 0), build_model(t2, recipe, 0), build_model(t1, recipe, 1)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    assert any(not torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters(), strict=True))
    ex = get_task("arithmetic").examples(64, seed=0)
    for x, y in zip(sft_tensors(t1, ex), sft_tensors(t2, ex), strict=True):
        assert torch.equal(x, y)
    ids, mask, labels = sft_tensors(t1, ex[:1])
    n_answer = len(ex[0].answer) + 1  # answer characters + eos
    assert int((labels[0] != -100).sum()) == n_answer and int(mask.sum()) == ids.shape[1]
