"""CUDA graphs of a stage's forward for decode-only steps (one token per request, no drafts),
captured once per padded batch size; every other step runs eagerly.

A step of n requests replays the graph of the smallest captured size >= n: its inputs are
copied into the graph's static buffers, the rows past n are padding that write their KV into
a scratch block no request owns (the pool's last block, allocated for this) and attend to
that one slot. The output rows [0, n) are cloned before anyone else reads them: the next
replay rewrites the static output while an NCCL send of this one may still be in flight.
"""
from __future__ import annotations

import torch

from kernels.paged_attention import DecodeLayout
from stages.model import AttentionMetadata
from stages.profiling import phase

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, model, kv_caches, *, is_first: bool, hidden_size: int, max_rows: int,
                 max_blocks: int, scratch_block: int, block_size: int, dtype: torch.dtype) -> None:
        dev = torch.device("cuda")
        self.sizes = [s for s in CAPTURE_SIZES if s < max_rows] + [max_rows]
        B = self.sizes[-1]
        self.is_first = is_first
        self.x = torch.zeros(B, dtype=torch.long, device=dev) if is_first else \
            torch.zeros(B, hidden_size, dtype=dtype, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slots = torch.full((B,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.tables = torch.full((B, max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.ctx = torch.ones(B, dtype=torch.long, device=dev)
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            meta = self._meta(b)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: kernels compiled, workspaces made
                for _ in range(2):
                    model(self.x[:b], meta, kv_caches)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model(self.x[:b], meta, kv_caches)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def _meta(self, b: int) -> AttentionMetadata:
        rows = torch.arange(b, device=self.positions.device)
        layout = DecodeLayout(token_rows=rows, table_rows=rows, ctx_lens=self.ctx[:b],
                              long_chunks=[], all_decode=True)
        return AttentionMetadata(positions=self.positions[:b], slot_mapping=self.slots[:b],
                                 block_tables=self.tables[:b], seq_lens=[1] * b,
                                 query_start_loc=list(range(b + 1)), layout=layout)

    def run(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        b = next(s for s in self.sizes if s >= n)
        graph, out = self.graphs[b]
        with phase("graph inputs"):
            self._copy_inputs(x, meta, n, b)
        with phase("graph replay"):
            graph.replay()
        with phase("graph output"):
            return out[:n].clone()

    def _copy_inputs(self, x: torch.Tensor, meta: AttentionMetadata, n: int, b: int) -> None:
        w = meta.block_tables.shape[1]
        self.x[:n].copy_(x)
        self.positions[:n].copy_(meta.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n, :w].copy_(meta.block_tables)
        self.ctx[:n].copy_(meta.layout.ctx_lens)
        if b > n:  # padding rows: one token at position 0 in the scratch block
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.scratch_slot)
            self.tables[n:b, 0].fill_(self.scratch_block)
            self.ctx[n:b].fill_(1)
