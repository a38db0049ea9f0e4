"""Tiny random models and a char-level tokenizer for the sampling / Fisher tests (no zoo needed),
and the one-backward-per-row Fisher reference the real-model tests hold the engine against."""

from __future__ import annotations

from typing import Any

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


# --------------------------------------------------------------------------------------------
# Tiny random models of many transformers families (the architecture matrix)
# --------------------------------------------------------------------------------------------

H, FF, LAYERS, POS = 16, 32, 2, 64
_STD = {"hidden_size": H, "intermediate_size": FF, "num_hidden_layers": LAYERS,
        "num_attention_heads": 2, "max_position_embeddings": POS}
_GQA = {**_STD, "num_key_value_heads": 1}

# family -> (config class, model class, config kwargs, whether the family can untie the head)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             {"n_embd": H, "n_layer": LAYERS, "n_head": 2, "n_positions": POS}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _GQA),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_GQA, "head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_GQA, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _GQA),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _STD),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _STD),
    "falcon_rotary": ("FalconConfig", "FalconForCausalLM",
                      {"hidden_size": H, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
                       "alibi": False, "new_decoder_architecture": False}),
    "falcon_alibi": ("FalconConfig", "FalconForCausalLM",
                     {"hidden_size": H, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
                      "alibi": True, "new_decoder_architecture": False}),
    "phi": ("PhiConfig", "PhiForCausalLM", _STD),
    "bloom": ("BloomConfig", "BloomForCausalLM",
              {"hidden_size": H, "n_layer": LAYERS, "n_head": 2}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             {"n_embd": H, "n_layer": LAYERS, "n_head": 2, "n_positions": POS, "rotary_dim": 4}),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    {"n_embd": H, "n_layer": LAYERS, "n_head": 2, "n_positions": POS}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {**_GQA, "logit_scale": 0.25}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _GQA),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {**_STD, "num_key_value_heads": 2}),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM",
                {"hidden_size": H, "num_layers": LAYERS, "num_heads": 2, "window_size": 4,
                 "attention_types": [[["global", "local"], 1]], "max_position_embeddings": POS}),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM",
                {"n_embd": H, "n_layer": LAYERS, "n_head": 2, "n_positions": POS, "n_ctx": POS,
                 "rotary_dim": 4}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {**_GQA, "sliding_window": None}),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", _STD),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                {**_GQA, "logits_scaling": 4.0, "embedding_multiplier": 2.0,
                 "residual_multiplier": 0.5, "attention_multiplier": 0.3}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_GQA, "head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {**_GQA, "head_dim": 8, "final_logit_softcapping": 2.0, "sliding_window": 4}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {**_GQA, "head_dim": 8, "sliding_window": 4}),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", {**_GQA, "head_dim": 8}),
    "xglm": ("XGLMConfig", "XGLMForCausalLM",
             {"d_model": H, "num_layers": LAYERS, "attention_heads": 2, "ffn_dim": FF,
              "max_position_embeddings": POS, "scale_embedding": True}),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", {**_STD, "scale_embedding": True}),
    "opt": ("OPTConfig", "OPTForCausalLM",
            {"hidden_size": H, "ffn_dim": FF, "num_hidden_layers": LAYERS,
             "num_attention_heads": 2, "max_position_embeddings": POS,
             "word_embed_proj_dim": H}),
    "mamba": ("MambaConfig", "MambaForCausalLM",
              {"hidden_size": H, "state_size": 4, "num_hidden_layers": LAYERS, "expand": 2,
               "conv_kernel": 3}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**_GQA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                   "shared_expert_intermediate_size": 8}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {**_GQA, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {**_GQA, "num_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {**_GQA, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "sliding_window": 4}),
}


def family_model(family: str, tied: bool = False, vocab: int = VOCAB, seed: int = 0,
                 dtype=torch.float32):
    """A tiny random model of `family` (see FAMILIES); eval mode, dropout off, larger weights."""
    import transformers

    cfg_name, model_name, kw = FAMILIES[family]
    cfg_cls = getattr(transformers, cfg_name)
    cfg = cfg_cls(vocab_size=vocab, tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1,
                  eos_token_id=1, **kw)
    for k in ("attn_pdrop", "embd_pdrop", "resid_pdrop", "dropout", "attention_dropout",
              "hidden_dropout", "activation_dropout", "hidden_dropout_prob",
              "attention_probs_dropout_prob"):
        if hasattr(cfg, k) and isinstance(getattr(cfg, k), float):
            setattr(cfg, k, 0.0)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.to(dtype).eval()


# --------------------------------------------------------------------------------------------
# Brute-force Fisher reference for the real-model tests (one backward per row, float32)
# --------------------------------------------------------------------------------------------


def check_sequence_fisher_per_row(model, tok, texts: list[str], prompt_tokens: int = 2,
                                  allow_unreached: bool = False) -> dict[str, torch.Tensor]:
    """Pack `texts` right-padded (the first `prompt_tokens` tokens of each row are the prompt),
    run the engine's sequence Fisher with batch_size 1 < N rows, and hold it against one backward
    per row in float32 (compute.fisher.reference): the mean over rows of the squared gradient of
    the row's summed completion log-probability. Asserts the same tensor names, a total relative
    error <= 1e-4 and each tensor's relative error <= 1e-3. A tensor that no row reaches (zero
    reference) fails unless `allow_unreached`, in which case the engine must give it zero too.
    Returns the engine's Fisher."""
    from compute.fisher.reference import TENSOR_RTOL, TOTAL_RTOL, compare_sequence_fisher

    assert (TOTAL_RTOL, TENSOR_RTOL) == (1e-4, 1e-3)  # the thresholds the docstring promises
    check = compare_sequence_fisher(model, tok, texts, prompt_tokens, batch_size=1)
    assert check.names_match, (set(check.got) ^ set(check.ref))
    assert sum(float(v.abs().sum()) for v in check.ref.values()) > 0
    # every tensor, not just the sum (a zero-filled one would fail here)
    assert check.passes(allow_unreached), check.failures(allow_unreached)
    return check.got


class ParityTask:
    """A verifiable task's prompts with a reward a random model earns about half the time (the
    completion's length is odd): a GRPO batch with non-zero advantages, for the bound tests."""

    def __init__(self, base: Any):
        self.base = base

    def examples(self, *a: Any, **k: Any) -> Any:
        return self.base.examples(*a, **k)

    def reward(self, completion: str, answer: Any) -> float:
        return float(len(completion) % 2)
