"""The zoo's character-level tokenizer and the SFT tensors built with it."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
# Every character the tokenizer knows (specials first). Enough for arithmetic and simple JSONL.
CHARS = "0123456789+-*/=.,()?: abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"


def build_tokenizer() -> Any:
    """Character-level PreTrainedTokenizerFast: one token per character, pad/eos/bos/unk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character alone
    tok.decoder = decoders.Fuse()  # join tokens without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="right",
        model_max_length=256,
    )


def is_val(prompt: str) -> bool:
    """Train-split problems held out of SFT for checkpoint selection (by hash, about 1 in 8)."""
    return int.from_bytes(hashlib.sha256(b"val|" + prompt.encode()).digest()[:4], "big") % 8 == 0


def sft_tensors(tokenizer: Any, examples: list[Any]) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, labels), each (N, L), right-padded; labels on answer + eos."""
    rows, label_rows = [], []
    eos = tokenizer.eos_token_id  # property lookups are slow: read once
    unique = sorted({ex.prompt for ex in examples} | {ex.answer for ex in examples})
    encoded = dict(zip(unique, tokenizer(unique)["input_ids"], strict=True))
    for ex in examples:
        p, a = encoded[ex.prompt], encoded[ex.answer] + [eos]
        rows.append(p + a)
        label_rows.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in label_rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids, mask, labels
