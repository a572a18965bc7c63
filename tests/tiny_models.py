"""Tiny random-weight HF checkpoints of each supported architecture, built on the spot.

Weights are drawn wider than HF's default init so that greedy choices have clear margins
(near-ties are what the tie rule excuses, and we want few of them). Layer counts (5, 7) do
not divide evenly by PP sizes 2, 3 and 4.
"""
from __future__ import annotations

import os

import torch

VOCAB = 384


def _config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.25,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":  # GQA, untied head, llama3 rope scaling
        return LlamaConfig(num_hidden_layers=5, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                            "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 128},
                           **common)
    if arch == "mistral":  # tied head
        return MistralConfig(num_hidden_layers=5, tie_word_embeddings=True, sliding_window=None,
                             **common)
    if arch == "qwen2":  # qkv bias
        return Qwen2Config(num_hidden_layers=7, tie_word_embeddings=False, **common)
    if arch == "qwen3":  # q/k norm, explicit head_dim != hidden / heads
        return Qwen3Config(num_hidden_layers=5, head_dim=32, tie_word_embeddings=True, **common)
    raise KeyError(arch)


ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def make_tiny_model(arch: str, root: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    path = os.path.join(root, arch)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    with torch.no_grad():  # biases and norm weights off their defaults, so loading them matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def make_draft_model(arch: str, root: str, noise: float = 0.01, seed: int = 1) -> str:
    """A draft for speculative decoding: the target's checkpoint with every weight nudged by
    relative noise, so that it agrees with the target often but not always (same vocabulary)."""
    from transformers import AutoModelForCausalLM

    path = os.path.join(root, f"{arch}-draft-{noise}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(arch, root), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.abs().mean())
    model.save_pretrained(path)
    return path


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tiny_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer of VOCAB ids (specials <pad>=0, <s>=1, </s>=2, as the tiny
    configs' bos/eos), trained on a few sentences: multi-byte characters span several tokens,
    which is what incremental detokenization must get right."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello ray",
              "pipeline parallel inference on a cluster", "héllo wörld ünïcode façade",
              "日本語のテキスト", "emoji 🙂 🚀 stream"] * 4
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    assert len(fast) <= VOCAB, len(fast)


def make_tiny_model_with_tokenizer(arch: str, root: str) -> str:
    """make_tiny_model's checkpoint (linked, not copied) plus make_tiny_tokenizer's files."""
    src = make_tiny_model(arch, root)
    path = os.path.join(root, f"{arch}-tok")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(src):
        if not os.path.exists(os.path.join(path, name)):
            os.symlink(os.path.join(src, name), os.path.join(path, name))
    make_tiny_tokenizer(path)
    return path
