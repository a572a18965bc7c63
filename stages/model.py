"""One pipeline stage of a Llama-family model, built from a HF checkpoint.

Stage r of P holds decoder layers [start, end) only; the first stage also holds the token
embeddings, the last the final norm and the LM head (tied or not). Only those tensors are
read from the safetensors files. The math follows transformers' Llama / Mistral / Qwen2 /
Qwen3 modules op for op, so that float32 results match its `generate`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from kernels.layer_ops import (RopeCosSin, add_rms_norm, attention_inputs, fused_kernels, linear,
                               rms_norm, silu_and_mul)
from kernels.paged_attention import (DecodeLayout, decode_layout_arrays, paged_attention,
                                     prefill_tile_arrays)
from ray_runtime.layer_span import LayerSpan, StageBlocks
from stages.model_spec import ModelSpec


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [num_reqs, max_blocks]
    seq_lens: list[int]  # [num_reqs] context length after this step
    query_start_loc: list[int]  # [num_reqs + 1]
    layout: Optional[DecodeLayout] = None  # which rows run as decode rows, once per step


def token_layout(rows: np.ndarray, starts: np.ndarray, num_new: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row r runs num_new[r] tokens from position starts[r]: query_start_loc, and per token
    its row and position."""
    if len(num_new) and (num_new == 1).all():  # a decode step: one token per row
        # rows and starts themselves (read-only downstream: every user indexes or copies)
        return np.arange(len(rows) + 1), rows, starts
    query_start_loc = np.concatenate([[0], np.cumsum(num_new)])
    total = int(query_start_loc[-1])
    token_row = np.repeat(rows, num_new)
    positions = np.arange(total) - np.repeat(query_start_loc[:-1], num_new) + np.repeat(starts, num_new)
    return query_start_loc, token_row, positions


def plain_to_device(device: str) -> Callable[[list[np.ndarray]], list[torch.Tensor]]:
    return lambda arrays: [torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(device)
                           for a in arrays]


def attention_metadata(block_table: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                       num_new: np.ndarray, block_size: int, device: str, *,
                       to_device: Optional[Callable] = None, extras: Sequence[np.ndarray] = (),
                       layout: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None,
                       device_table=None
                       ) -> tuple[AttentionMetadata, np.ndarray, np.ndarray, list[torch.Tensor]]:
    """Row r runs num_new[r] tokens from position starts[r]: their attention metadata, per
    token its row and position, and `extras` (more int64 host arrays the step needs on the
    device) moved along with the metadata by one `to_device` call (the runner's staging: one
    pinned copy per step). layout: token_layout() of the same rows, if the caller has it.
    device_table: a DeviceBlockTable mirroring block_table: its changed rows travel in the
    same copy, and the step's tables are gathered on the device instead of shipped."""
    query_start_loc, token_row, positions = layout or token_layout(rows, starts, num_new)
    slot_mapping = block_table[token_row, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    ends = starts + num_new
    max_blocks = int(-(-ends.max() // block_size))
    token_rows, table_rows, ctx_lens, long_chunks, all_decode = \
        decode_layout_arrays(ends, query_start_loc)
    tables = block_table[rows, :max_blocks] if device_table is None else rows
    mirror = device_table.changes() if device_table is not None else []
    # CUDA: the prefill kernel's tiles travel in the same copy (ends: each request's context)
    tiles = prefill_tile_arrays(ends, query_start_loc, long_chunks) \
        if long_chunks and device == "cuda" else []
    moved = (to_device or plain_to_device(device))(
        [positions, slot_mapping, tables, token_rows, table_rows, ctx_lens, *mirror, *extras,
         *tiles])
    pos_t, slots_t, tables_t, token_rows_t, table_rows_t, ctx_t = moved[:6]
    if device_table is not None:
        device_table.apply(*moved[6:8])
        tables_t = device_table.gather(tables_t, max_blocks)
    n = 6 + len(mirror) + len(extras)
    extras_t, tiles_t = moved[6 + len(mirror):n], moved[n:]
    meta = AttentionMetadata(
        positions=pos_t, slot_mapping=slots_t, block_tables=tables_t,
        seq_lens=ends.tolist(), query_start_loc=query_start_loc.tolist(),
        layout=DecodeLayout(token_rows_t, table_rows_t, ctx_t, long_chunks, all_decode,
                            tuple(tiles_t) or None))
    return meta, token_row, positions, extras_t


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin tables from transformers' own rope initializers, so every rope_type it
    implements statically (default, linear, llama3, yarn, ...) matches it exactly."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        with open(os.path.join(spec.model_dir, "config.json")) as f:
            raw = json.load(f)
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            # The common case needs no transformers import (seconds per stage process).
            base = params.get("rope_theta", raw.get("rope_theta", 10000.0))
            dim = spec.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        else:
            import importlib

            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            module = importlib.import_module(
                f"transformers.models.{spec.family}.configuration_{spec.family}")
            config_cls = next(getattr(module, n) for n in dir(module)
                              if n.endswith("Config") and n.lower() == f"{spec.family}config")
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config_cls(**raw))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def tables(self, num_positions: int, dtype: torch.dtype, device) -> RopeCosSin:
        """cos/sin for every position below num_positions, by forward()'s own ops (an
        elementwise op on CUDA gives an element the same value in any tensor), for a fused
        kernel to index by position instead of computing them every step."""
        positions = torch.arange(num_positions, device=device)
        return RopeCosSin(*(t.contiguous() for t in self(positions, dtype)))


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        nh, nkv, hd, h = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
        self.q_proj = nn.Linear(h, nh * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps)
        self.scale = hd ** -0.5
        self.qkv_proj: Optional[nn.Linear] = None  # set by fuse(): q, k and v in one GEMM

    def fuse(self) -> None:
        """One GEMM for q, k and v (half precision on CUDA: fewer, larger kernels). The CPU
        float32 path keeps three, as transformers computes them."""
        self.qkv_proj = _concat_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, rope: RopeCosSin, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        spec, n = self.spec, x.shape[0]
        nq, nkv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        if self.qkv_proj is not None:  # views into one output; the kernels take strides
            qkv = linear(x, self.qkv_proj)
            q = qkv[:, :nq].view(n, spec.num_heads, spec.head_dim)
            k = qkv[:, nq:nq + nkv].view(n, spec.num_kv_heads, spec.head_dim)
            v = qkv[:, nq + nkv:].view(n, spec.num_kv_heads, spec.head_dim)
        else:
            q = self.q_proj(x).view(n, spec.num_heads, spec.head_dim)
            k = self.k_proj(x).view(n, spec.num_kv_heads, spec.head_dim)
            v = self.v_proj(x).view(n, spec.num_kv_heads, spec.head_dim)
        q = attention_inputs(q, k, v, self.q_norm.weight if spec.qk_norm else None,
                             self.k_norm.weight if spec.qk_norm else None, spec.rms_norm_eps,
                             rope, kv, meta.slot_mapping)
        key_cache, value_cache = kv
        out = paged_attention(q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                              meta.query_start_loc, self.scale, meta.layout)
        return linear(out.reshape(n, -1), self.o_proj)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, i, b = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gate_up_proj: Optional[nn.Linear] = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up_proj = _concat_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = linear(x, self.gate_up_proj)
            i = gate_up.shape[-1] // 2
            return linear(silu_and_mul(gate_up[:, :i], gate_up[:, i:]), self.down_proj)
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


def _concat_linears(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side."""
    w = torch.cat([p.weight for p in parts])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None,
                      device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(w)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(False)


class DecoderLayer(nn.Module):
    """A decoder layer, or one of its two blocks where a stage boundary splits it
    (ray_runtime/layer_span.py): attention=False holds only the MLP block, mlp=False only the
    attention block."""

    def __init__(self, spec: ModelSpec, attention: bool = True, mlp: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if attention else None
        self.self_attn = Attention(spec) if attention else None
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if mlp else None
        self.mlp = MLP(spec) if mlp else None

    def forward(self, x, residual, rope, meta, kv, mlp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the last block's output, the residual stream before it): the caller (or
        the next block's fused norm) adds them, as transformers' `residual + hidden_states`
        does. residual None: x is the whole residual stream (a stage's first block).
        mlp=False: the attention block alone (a held MLP block that this step's split runs on
        the next stage)."""
        if self.self_attn is not None:
            if residual is None:
                residual, h = x, self.input_layernorm(x)
            else:
                h, residual = self.input_layernorm.add(x, residual)
            x = self.self_attn(h, rope, meta, kv)
        if self.mlp is None or not mlp:
            return x, residual
        if residual is None:
            residual, h = x, self.post_attention_layernorm(x)
        else:
            h, residual = self.post_attention_layernorm.add(x, residual)
        return self.mlp(h), residual


class StageModel(nn.Module):
    def __init__(self, spec: ModelSpec, span: LayerSpan, is_first: bool, is_last: bool,
                 prefill_span: Optional[LayerSpan] = None) -> None:
        """span: the blocks a step runs here; prefill_span: a prefill-shaped step's, if they
        differ (the same attention blocks; ray_runtime/layer_span.py). The stage holds both."""
        super().__init__()
        if not isinstance(span, LayerSpan):  # a plain (first, end) would be read as halves
            raise TypeError(f"a stage's layers are a LayerSpan, got {span!r}")
        blocks = StageBlocks(span, prefill_span or span)
        blocks.check()
        self.spec, self.span, self.prefill_span = spec, span, blocks.prefill
        self.held = held = blocks.held
        self.is_first, self.is_last = is_first, is_last
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size) if is_first else None
        self.layers = nn.ModuleList(DecoderLayer(spec, held.has_attention(i), held.has_mlp(i))
                                    for i in held.layers)
        # per held layer, for each kind of step: (runs it at all, runs its MLP block)
        self._runs = {kind: [(s.has_attention(i) or s.has_mlp(i), s.has_mlp(i)) for i in held.layers]
                      for kind, s in ((False, span), (True, blocks.prefill))}
        self.num_attention_layers = len(held.attention_layers)
        self.num_prefill_split_runs = 0  # forwards on prefill_span's blocks
        self.rotary = Rotary(spec)
        # set by build_stage where the layers' kernels are fused: cos/sin for every position
        self.rope_tables: Optional[RopeCosSin] = None
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if is_last else None
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if is_last else None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                prefill_shaped: bool = False) -> torch.Tensor:
        """x: token ids [num_tokens] on the first stage, else hidden states [num_tokens, hidden].
        kv_caches: one per layer whose attention is here (LayerSpan.attention_layers).
        prefill_shaped: run prefill_span's blocks (StepPlan.prefill_shaped), else span's."""
        if self.is_first:
            x = self.embed_tokens(x)
        tables = self.rope_tables
        rope = RopeCosSin(tables.cos, tables.sin, meta.positions) if tables is not None \
            else RopeCosSin(*self.rotary(meta.positions, x.dtype))
        residual = None
        if len(kv_caches) != self.num_attention_layers:
            raise ValueError(f"stage {self.span.label()}: {len(kv_caches)} KV caches for "
                             f"{self.num_attention_layers} attention layers")
        caches = iter(kv_caches)
        self.num_prefill_split_runs += prefill_shaped
        for layer, (runs, mlp) in zip(self.layers, self._runs[prefill_shaped]):
            kv = next(caches) if layer.self_attn is not None else None
            if runs:
                x, residual = layer(x, residual, rope, meta, kv, mlp)
        return x if residual is None else residual + x

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits in float32; upcast=False keeps the model's dtype, which is enough for an
        argmax (the conversion is exact and keeps the order, ties included) and saves a
        [rows, vocab] copy and half the argmax's reads on the last rank's every step."""
        logits = linear(self.norm(hidden), self.lm_head)
        return logits.float() if upcast else logits

    # ---- loading -------------------------------------------------------------------------
    def checkpoint_names(self) -> dict[str, str]:
        """Our parameter name -> the checkpoint's tensor name, for this stage only."""
        start = self.held.layers.start
        names = {}
        for ours in self.state_dict():
            if ours.startswith("rotary."):
                continue
            if ours.startswith("layers."):
                idx, rest = ours[len("layers."):].split(".", 1)
                names[ours] = f"model.layers.{start + int(idx)}.{rest}"
            elif ours == "lm_head.weight":
                names[ours] = "model.embed_tokens.weight" if self.spec.tie_word_embeddings \
                    else "lm_head.weight"
            else:
                names[ours] = f"model.{ours}"
        return names

    def load_checkpoint(self, dtype: torch.dtype, device: str) -> None:
        wanted = self.checkpoint_names()
        files = _tensor_files(self.spec.model_dir)
        state: dict[str, torch.Tensor] = {}
        by_ckpt: dict[str, list[str]] = {}
        for ours, ckpt in wanted.items():
            by_ckpt.setdefault(ckpt, []).append(ours)
        for path, keys in _group_by_file(files, set(by_ckpt)).items():
            with safe_open(path, framework="pt") as f:
                present = set(f.keys())
                for key in keys:
                    if key not in present:
                        continue
                    tensor = f.get_tensor(key).to(dtype)
                    for ours in by_ckpt[key]:
                        state[ours] = tensor
        missing = sorted(set(wanted) - set(state))
        if missing:
            raise ValueError(f"model: checkpoint {self.spec.model_dir!r} lacks tensors "
                             f"{[wanted[m] for m in missing][:5]}")
        self.load_state_dict(state, strict=False, assign=True)
        self.rotary = Rotary(self.spec)  # built for real: the module skeleton was on "meta"
        self.to(device=device)
        self.eval()


def build_stage(spec: ModelSpec, span: LayerSpan, is_first: bool, is_last: bool,
                dtype: torch.dtype, device: str, max_positions: Optional[int] = None,
                prefill_span: Optional[LayerSpan] = None) -> StageModel:
    """Allocate nothing for the skeleton (meta device), then take the checkpoint's tensors.
    max_positions: the most positions a step of this engine runs at (its max_model_len), the
    rows of the rope tables the fused kernel indexes without a bound check; default the
    checkpoint's max_position_embeddings. A draft model must be given the target's: its
    positions follow the target's requests, not its own checkpoint's context."""
    with torch.device("meta"):
        model = StageModel(spec, span, is_first, is_last, prefill_span)
    model.load_checkpoint(dtype, device)
    if fused_kernels(device, dtype):
        model.rope_tables = model.rotary.tables(max_positions or spec.max_position_embeddings,
                                                dtype, device)
        for layer in model.layers:
            if layer.self_attn is not None:
                layer.self_attn.fuse()
            if layer.mlp is not None:
                layer.mlp.fuse()
    return model


def _tensor_files(model_dir: str) -> dict[str, Optional[str]]:
    """tensor name -> file, from the index when sharded; {"*": file} when single."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"model: no safetensors weights in {model_dir!r}")
    return {"*": single}


def _group_by_file(files: dict[str, Optional[str]], keys: set[str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for key in sorted(keys):
        path = files.get(key, files.get("*"))
        if path is None:
            continue
        grouped.setdefault(path, []).append(key)
    return grouped
