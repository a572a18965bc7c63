"""What the runtime needs to know about a HF checkpoint, read from its config files alone."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ray_runtime.config import SUPPORTED_ARCHITECTURES, load_hf_config

UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")  # depend on the running sequence length


@dataclass(frozen=True)
class ModelSpec:
    model_dir: str
    family: str  # llama | mistral | qwen2 | qwen3
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelSpec":
        cfg = load_hf_config(model_dir)
        family = SUPPORTED_ARCHITECTURES[cfg["architectures"][0]]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in UNSUPPORTED_ROPE_TYPES:
            raise ValueError(f"model: rope type {rope_type!r} is not supported "
                             f"(it depends on the running sequence length)")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        if family == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if family == "mistral" and cfg.get("sliding_window"):
            # Exact attention is full attention only while sequences fit the window.
            max_pos = min(max_pos, int(cfg["sliding_window"]))
        if family == "qwen2" and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            max_pos = min(max_pos, int(cfg["sliding_window"]))
        return cls(
            model_dir=model_dir, family=family, num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"], num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads, head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3", max_position_embeddings=max_pos,
            eos_token_ids=_eos_ids(model_dir, cfg))

    @property
    def attention_share(self) -> float:
        """An attention block's share of a decoder layer's weights (q, k, v and o against
        gate, up and down): what it costs of the layer in a prefill step, where the work
        goes as the weights' (ray_runtime/layer_span.py)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h
        return attention / (attention + 3 * h * self.intermediate_size)


def _eos_ids(model_dir: str, cfg: dict) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [cfg]
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f))
    for src in sources:
        eos = src.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return tuple(sorted(ids))
