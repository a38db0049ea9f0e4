"""The zoo: shipped weights match their manifest, install verified by sha256, load with plain
transformers; accuracies are recorded (in the committed manifest) and in range."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from app.cli import main
from compute.contract.modelref import REAL_MODEL_NAMES, ZOO_NAMES, model_revision, resolve_model
from compute.lm.causal_lm import greedy_accuracy, load_model
from compute.lm.verifiable_tasks import get_task
from compute.zoo import (
    FAMILIES,
    INFO_FILE,
    SHIPPED_FILES,
    WEIGHTS_DIR,
    ZooRecipe,
    build_model,
    build_tokenizer,
    build_zoo,
    file_sha256,
    folder_revision,
    install_shipped,
    read_manifest,
    sft_tensors,
    zoo_list,
)
from compute.zoo.build import cpu_fingerprint


@pytest.fixture
def home(zoo_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    return zoo_home


def _info(home: Path, name: str) -> dict:
    return json.loads((home / "zoo" / name / INFO_FILE).read_text())


def test_manifest_matches_shipped_files() -> None:
    manifest = read_manifest()
    assert sorted(manifest["models"]) == sorted(ZOO_NAMES)
    layers = {"arith-base": 2, "arith-teacher": 2, "arith-deep-base": 8, "arith-deep-teacher": 8}
    for name in ZOO_NAMES:
        entry = manifest["models"][name]
        folder = WEIGHTS_DIR / name
        assert sorted(entry["files"]) == sorted(SHIPPED_FILES)
        for fname, digest in entry["files"].items():
            assert file_sha256(folder / fname) == digest, (name, fname)
            assert (folder / fname).stat().st_size < 5 * 2**20  # no tracked file over 5 MB
        assert entry["revision"] == folder_revision(folder)
        info = json.loads((folder / INFO_FILE).read_text())
        cfg = json.loads((folder / "config.json").read_text())
        assert entry["accuracy"] == info["accuracy"] and entry["params"] == info["params"]
        assert entry["n_layers"] == cfg["num_hidden_layers"] == layers[name]
        assert entry["seed"] == 0 and entry["accuracy_prompts"] == 500
    models = manifest["models"]
    for fam, (_, base, teacher) in FAMILIES.items():
        assert 0.10 <= models[base]["accuracy"] <= 0.45, (fam, models[base]["accuracy"])
        assert models[teacher]["accuracy"] >= models[base]["accuracy"] + 0.3, fam


def test_install_refuses_a_tampered_file_and_installs_verified_copies(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    shutil.copytree(WEIGHTS_DIR, weights)
    blob = bytearray((weights / "arith-base" / "model.safetensors").read_bytes())
    blob[-1] ^= 1  # one bit of one weight
    (weights / "arith-base" / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(
        ValueError, match=r"arith-base/model.safetensors has sha256 .* manifest says"
    ):
        install_shipped(tmp_path / "zoo", "arith-base", weights_dir=weights)
    assert not (tmp_path / "zoo" / "arith-base").exists()
    assert not [p for p in (tmp_path / "zoo").iterdir()]  # no temporary folder left behind
    info = install_shipped(tmp_path / "zoo", "arith-teacher", weights_dir=weights)
    entry = read_manifest()["models"]["arith-teacher"]
    assert info["accuracy"] == entry["accuracy"]
    assert folder_revision(tmp_path / "zoo" / "arith-teacher") == entry["revision"]
    with pytest.raises(ValueError, match="seed: 3; the shipped weights were trained with seed 0"):
        build_zoo(tmp_path / "zoo", ["arith-base"], seed=3)


@pytest.mark.slow
def test_from_scratch_build_is_deterministic(tmp_path: Path) -> None:
    """Two from-scratch builds on this machine give the same bytes (fixed seed, one thread)."""
    a = build_zoo(tmp_path / "a", ["arith-base"], from_scratch=True)[0]
    b = build_zoo(tmp_path / "b", ["arith-base"], from_scratch=True)[0]
    digest = [file_sha256(d / "arith-base" / "model.safetensors") for d in (tmp_path / "a", tmp_path / "b")]
    assert digest[0] == digest[1]
    assert a["accuracy"] == b["accuracy"] and a["train_steps"] == b["train_steps"]
    assert a["cpu_fingerprint"] == cpu_fingerprint()


@pytest.mark.slow
def test_from_scratch_build_reproduces_the_shipped_digest(tmp_path: Path) -> None:
    """Bit-for-bit on a machine like the one the weights were shipped from. `cpu_capability` alone
    is not enough: an AMX machine (AVX512 too) trains other bytes than the shipping machine did,
    so `ship` records `cpu_fingerprint` and this test compares only where it matches."""
    entry = read_manifest()["models"]["arith-base"]
    shipped = (entry["torch_version"], entry.get("cpu_fingerprint"))
    if shipped != (torch.__version__, cpu_fingerprint()):
        pytest.skip(
            f"shipped weights built with torch {entry['torch_version']}, CPU fingerprint "
            f"{entry.get('cpu_fingerprint') or 'not recorded'}; here torch {torch.__version__}, "
            f"{cpu_fingerprint()}: MKL and the vector units may round differently"
        )
    info = build_zoo(tmp_path, ["arith-base"], from_scratch=True)[0]
    assert file_sha256(tmp_path / "arith-base" / "model.safetensors") == entry["files"]["model.safetensors"]
    assert info["accuracy"] == entry["accuracy"] and info["train_steps"] == entry["train_steps"]


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


@pytest.mark.parametrize("base_name", ["arith-base", "arith-deep-base"])
def test_accuracies_recorded_in_range_and_reproducible(home: Path, base_name: str) -> None:
    teacher_name = base_name.replace("base", "teacher")
    base, teacher = _info(home, base_name), _info(home, teacher_name)
    assert 0.10 <= base["accuracy"] <= 0.45, base["accuracy"]
    assert teacher["accuracy"] >= 0.70, teacher["accuracy"]
    assert teacher["accuracy"] >= base["accuracy"] + 0.3
    for info in (base, teacher):
        assert info["accuracy_split"] == "test" and info["accuracy_decoding"] == "greedy"
        assert info["params"] > 0 and info["train_steps"] > 0 and info["seed"] == 0
        assert info["build_seconds"] > 0
    # the recorded number is what greedy decoding on the test split gives now
    model, tok = load_model(base_name, device="cpu", dtype="float32")
    measured = greedy_accuracy(model, tok, "arithmetic", n=base["accuracy_prompts"], split="test")
    assert measured == pytest.approx(base["accuracy"], abs=1e-9)
    assert model.num_parameters() == base["params"]


def test_modelref_on_zoo(home: Path) -> None:
    assert resolve_model("arith-teacher") == str(home.resolve() / "zoo" / "arith-teacher")
    rev = model_revision("arith-base")
    assert len(rev) == 64 and rev == model_revision("arith-base")
    assert rev != model_revision("arith-teacher")
    # the manifest's revision is the one every job records for the installed model
    assert rev == read_manifest()["models"]["arith-base"]["revision"]


def test_zoo_list_rows(home: Path, tmp_path: Path) -> None:
    rows = {r["name"]: r for r in zoo_list(home / "zoo")}
    assert list(rows) == [*ZOO_NAMES, *REAL_MODEL_NAMES]
    assert all(
        rows[n]["built"] and rows[n]["params"] > 0 and 0 <= rows[n]["accuracy"] <= 1
        for n in ZOO_NAMES
    )
    assert rows["arith-deep-base"]["n_layers"] == 8 and rows["arith-base"]["n_layers"] == 2
    assert "dequantised from Q4_1" in rows["smollm2-135m"]["note"]
    assert rows["smollm2-135m"]["how"] == "fisherlens zoo add smollm2-135m"
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
    for name in ZOO_NAMES:
        assert f"{name}:" in res.output
    assert "params" in res.output
    assert (home / "zoo" / "arith-base" / "model.safetensors").stat().st_mtime_ns == before
    res = runner.invoke(main, ["zoo", "build", "--names", "arith-base,bogus"])
    assert res.exit_code == 2 and "--names: unknown zoo model 'bogus'" in res.output
    res = runner.invoke(main, ["zoo", "build", "--seed", "3"])
    assert res.exit_code == 2 and "--seed: 3" in res.output and "--from-scratch" in res.output


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
