"""compute.contract.modelref and compute.lm.causal_lm: allowed roots, revisions, loading, device/dtype, greedy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compute.contract.modelref import model_revision, resolve_model
from compute.contract.settings import Settings
from compute.lm.causal_lm import (
    greedy_generate,
    load_model,
    model_info,
    resolve_device,
    resolve_dtype,
)
from compute.zoo import build_tokenizer


def _settings(tmp_path: Path, *roots: Path) -> Settings:
    return Settings(
        fisherlens_home=tmp_path / "home", allowed_model_roots=":".join(str(r) for r in roots)
    )


def _fake_model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"weights-v1")
    return path


# ---------------------------------------------------------------- modelref


def test_zoo_name_not_built_and_built(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    with pytest.raises(ValueError) as info:
        resolve_model("arith-base", s)
    assert (
        str(info.value) == "model: zoo model 'arith-base' is not built; run `fisherlens zoo build`"
    )
    _fake_model_dir(s.zoo_dir / "arith-base")
    assert resolve_model("arith-base", s) == str(s.zoo_dir / "arith-base")


def test_local_dir_inside_allowed_root(tmp_path: Path) -> None:
    root = tmp_path / "models"
    d = _fake_model_dir(root / "tiny")
    s = _settings(tmp_path, root)
    assert resolve_model(str(d), s) == str(d.resolve())
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(root / "missing"), s)
    (root / "noconfig").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(root / "noconfig"), s)


def test_local_dir_outside_roots_is_rejected(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    outside = _fake_model_dir(tmp_path / "elsewhere")
    s = _settings(tmp_path, root)
    with pytest.raises(ValueError) as info:
        resolve_model(str(outside), s)
    msg = str(info.value)
    assert msg.startswith("model: ") and "outside the allowed model roots" in msg
    # The roots are server paths: the message names the setting, never the folders (issue 8).
    assert str(root.resolve()) not in msg and str(s.zoo_dir) not in msg
    assert "ALLOWED_MODEL_ROOTS" in msg


def test_dotdot_escape_is_rejected(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    _fake_model_dir(tmp_path / "secret")
    s = _settings(tmp_path, root)
    with pytest.raises(ValueError, match=r"contains '\.\.'"):
        resolve_model(f"{root}/../secret", s)
    # also when the '..' stays inside the root: paths with '..' are refused outright
    _fake_model_dir(root / "ok")
    with pytest.raises(ValueError, match=r"contains '\.\.'"):
        resolve_model(f"{root}/ok/../ok", s)


def test_symlink_escape_is_rejected(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    target = _fake_model_dir(tmp_path / "secret")
    (root / "link").symlink_to(target, target_is_directory=True)
    s = _settings(tmp_path, root)
    with pytest.raises(ValueError, match="outside the allowed model roots"):
        resolve_model(str(root / "link"), s)
    # a symlinked root itself is fine: both sides are resolved
    real = tmp_path / "real"
    _fake_model_dir(real / "m")
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    s2 = _settings(tmp_path, tmp_path / "alias")
    assert resolve_model(str(tmp_path / "alias" / "m"), s2) == str((real / "m").resolve())


def test_hub_ids_and_unknown_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = _settings(tmp_path)
    assert resolve_model("Qwen/Qwen3-0.6B", s) == "Qwen/Qwen3-0.6B"
    for bad in ("gpt2-but-unknown", "a/b/c", "org/..", ""):
        with pytest.raises(ValueError) as info:
            resolve_model(bad, s)
        assert str(info.value).startswith("model: ")
    with pytest.raises(ValueError, match="arith-base, arith-teacher"):
        resolve_model("nonsense", s)


def test_model_revision(tmp_path: Path) -> None:
    root = tmp_path / "models"
    d = _fake_model_dir(root / "tiny")
    s = _settings(tmp_path, root)
    r1 = model_revision(str(d), s)
    assert r1 == model_revision(str(d), s) and len(r1) == 64
    (d / "notes.txt").write_text("irrelevant")
    assert model_revision(str(d), s) == r1
    (d / "model.safetensors").write_bytes(b"weights-v2-longer")
    r2 = model_revision(str(d), s)
    assert r2 != r1
    (d / "config.json").write_text('{"a": 1}')
    assert model_revision(str(d), s) not in (r1, r2)
    assert model_revision("org/name", s) == "org/name"


# ---------------------------------------------------------------- models


def _tiny(arch: str, vocab: int) -> torch.nn.Module:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    shape = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=8))
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape))
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    )


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt2"])
def test_load_local_models(tmp_path: Path, arch: str) -> None:
    tok = build_tokenizer()
    model = _tiny(arch, len(tok))
    path = tmp_path / "models" / arch
    model.save_pretrained(path)
    if arch == "gpt2":  # a tokenizer without pad token: load_model falls back to eos
        tok.pad_token = None
    tok.save_pretrained(path)
    s = _settings(tmp_path, tmp_path / "models")
    loaded, tokenizer = load_model(str(path), device="cpu", dtype="float32", settings=s)
    assert not loaded.training
    assert tokenizer.pad_token == ("<eos>" if arch == "gpt2" else "<pad>")
    for (n1, p1), (n2, p2) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2)
    info = model_info(loaded)
    assert info["n_layers"] == 2 and info["hidden_size"] == 32 and info["vocab_size"] == len(tok)
    assert info["n_params"] == sum(p.numel() for p in model.parameters())
    # batched greedy (left padding + cache) equals one-prompt-at-a-time argmax without cache
    prompts = ["1+1=", "12+34=", "7*8="]
    batched = greedy_generate(loaded, tokenizer, prompts, max_new_tokens=5)
    for prompt, got in zip(prompts, batched, strict=True):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        out = []
        for _ in range(5):
            nxt = int(loaded(input_ids=ids).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        assert got == tokenizer.decode(out, skip_special_tokens=True)
    lowp, _ = load_model(str(path), device="cpu", dtype="bfloat16", settings=s)
    assert next(lowp.parameters()).dtype == torch.bfloat16


def test_hub_id_without_network_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ValueError) as info:
        load_model("fisherlens-test/nonexistent", settings=_settings(tmp_path))
    assert str(info.value).startswith(
        "model: could not load 'fisherlens-test/nonexistent' from the hub (no network?): "
    )


def test_remote_code_is_not_run_by_default(tmp_path: Path) -> None:
    tok = build_tokenizer()
    path = tmp_path / "models" / "custom"
    _tiny("qwen3", len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    marker = tmp_path / "remote_code_ran"
    (path / "modeling_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from transformers import Qwen3ForCausalLM\nclass Evil(Qwen3ForCausalLM):\n    pass\n"
    )
    cfg = json.loads((path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Evil"}
    (path / "config.json").write_text(json.dumps(cfg))
    s = _settings(tmp_path, tmp_path / "models")
    try:
        model, _ = load_model(str(path), device="cpu", settings=s)
        assert type(model).__name__ == "Qwen3ForCausalLM"
    except ValueError as exc:
        assert str(exc).startswith("model: ")
    assert not marker.exists()


def test_resolve_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FISHERLENS_DEVICE", "cpu")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.delenv("FISHERLENS_DEVICE")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    with pytest.raises(ValueError, match="device: 'potato'"):
        resolve_device("potato")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype: 'int8'"):
        resolve_dtype("int8", "cpu")
