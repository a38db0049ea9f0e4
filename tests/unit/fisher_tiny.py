"""Tiny random models and a char-level tokenizer for the sampling / Fisher tests (no zoo needed)."""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

CHARS = list("0123456789+*=")


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


VOCAB = 3 + len(CHARS)


def tiny_model(arch: str = "qwen3", tied: bool = False, vocab: int = VOCAB, seed: int = 0,
               layers: int = 2, hidden: int = 16, dtype=torch.float32):
    torch.manual_seed(seed)
    if arch == "qwen3":
        cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=hidden // 2, tie_word_embeddings=tied, pad_token_id=0,
                          eos_token_id=1, max_position_embeddings=64)
        model = Qwen3ForCausalLM(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                          tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1,
                          max_position_embeddings=64)
        model = LlamaForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=2, n_positions=64,
                         tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1,
                         attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    # larger random weights than the HF init, so gradients are not all tiny
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.to(dtype).eval()
