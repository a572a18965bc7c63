"""CUDA graphs of a stage's forward for decode-only steps (one token per request, no drafts),
captured once per padded batch size; every other step runs eagerly.

A step of n requests replays the graph of the smallest captured size >= n. Its inputs are
staged straight into the buffer the graph reads (stages/graph_inputs.py: one copy); inside
the graph each row's block table is gathered from the device mirror and, on the first rank,
a fed sample patched into its input id. The rows past n are padding that write their KV
into a scratch block no request owns (the pool's last block, allocated for this) and attend
to that one slot. The output rows [0, n) are cloned before anyone else reads them: the next
replay rewrites the static output while an NCCL send of this one may still be in flight.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from kernels.paged_attention import DecodeLayout
from stages.graph_inputs import GraphInputs, StagedDecode
from stages.model import AttentionMetadata
from stages.profiling import phase

_EMPTY = np.zeros(0, np.int64)
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, model, kv_caches, *, is_first: bool, hidden_size: int, max_rows: int,
                 mirror: torch.Tensor, fed_tokens: torch.Tensor, scratch_block: int,
                 block_size: int, dtype: torch.dtype, depth: int = 2,
                 greedy_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 capture: bool = True) -> None:
        """mirror: the device block table (DeviceBlockTable.table; its last row is the pad
        row, every entry the scratch block); fed_tokens: each slot's latest sample on the
        device (what a first rank's fed ids read). greedy_head (the last rank): hidden
        states -> greedy tokens; each size then also has a graph that ends in it and writes
        the tokens to fed_tokens, for steps whose every row is greedy. capture=False runs
        the same step functions eagerly at each replay (CPU tests of the staged path)."""
        dev = mirror.device
        self.sizes = [s for s in CAPTURE_SIZES if s < max_rows] + [max_rows]
        B = self.sizes[-1]
        self.model, self.kv_caches = model, kv_caches
        self.block_size = block_size
        self.is_first, self.capture = is_first, capture
        self.mirror, self.fed_tokens = mirror, fed_tokens
        mirror[-1].fill_(scratch_block)
        self.inputs = GraphInputs(B, mirror.shape[1], table_rows=mirror.shape[0] - 1,
                                  scratch_slot=scratch_block * block_size,
                                  pad_row=mirror.shape[0] - 1, device=dev.type, depth=depth,
                                  has_ids=is_first)
        v = self.inputs.views  # every row padding until a step writes it
        v["slots"].fill_(scratch_block * block_size)
        v["ctx"].fill_(1)
        v["rows"].fill_(mirror.shape[0] - 1)
        self.x = None if is_first else torch.zeros(B, hidden_size, dtype=dtype, device=dev)
        self.arange = torch.arange(B, device=dev)
        self.greedy_head = greedy_head
        # (size, ends in the greedy head) -> the graph and its output
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if not capture:
            return
        from kernels.skinny_gemm_triton import timing_window  # (Triton: CUDA only)

        pool = torch.cuda.graph_pool_handle()
        variants = (False, True) if greedy_head is not None else (False,)
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            for head in variants:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                # warm-up: kernels compiled, workspaces made, the skinny GEMM timed per shape
                with torch.cuda.stream(side), timing_window():
                    for _ in range(2):
                        self._work(b, head)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._work(b, head)
                self.graphs[(b, head)] = (graph, out)
        torch.cuda.synchronize()

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int:
        """The captured size a step of n requests replays (n <= max_rows)."""
        return next(s for s in self.sizes if s >= n)

    def stage(self, rows: np.ndarray, positions: np.ndarray, token_ids: np.ndarray,
              patch_index: np.ndarray, sample_slots: np.ndarray, block_table: np.ndarray,
              device_table) -> StagedDecode:
        """A decode step (one token per row, at `positions`) staged for its graph: its inputs
        in one copy, and the block table rows changed since the last step (device_table, a
        DeviceBlockTable over this graph's mirror) scattered into the mirror."""
        bs = self.block_size
        slots = block_table[rows, positions // bs].astype(np.int64) * bs + positions % bs
        fed = _EMPTY
        if self.is_first:  # 1 where the id is the slot's latest fed sample
            fed = np.zeros(len(rows), np.int64)
            fed[patch_index] = 1
        dirty_slots, dirty_rows = device_table.changes()
        staged = self.inputs.stage(self.size_for(len(rows)), positions, slots, rows, token_ids,
                                   fed, sample_slots, dirty_slots, dirty_rows)
        device_table.apply(staged.dirty_slots, staged.dirty_rows)
        return staged

    def _step(self, b: int, seq_lens=None) -> torch.Tensor:
        """The captured work of a step of size b, reading only the static inputs: the block
        tables gathered from the mirror, a first rank's fed ids patched in."""
        v = self.inputs.views
        rows = v["rows"][:b]
        each = self.arange[:b]
        layout = DecodeLayout(token_rows=each, table_rows=each, ctx_lens=v["ctx"][:b],
                              long_chunks=[], all_decode=True)
        meta = AttentionMetadata(positions=v["positions"][:b], slot_mapping=v["slots"][:b],
                                 block_tables=self.mirror.index_select(0, rows),
                                 seq_lens=seq_lens or [1] * b, query_start_loc=list(range(b + 1)),
                                 layout=layout)
        if self.is_first:
            x = torch.where(v["fed"][:b] != 0, self.fed_tokens.index_select(0, rows), v["ids"][:b])
        else:
            x = self.x[:b]
        return self.model(x, meta, self.kv_caches)

    def _work(self, b: int, head: bool, seq_lens=None) -> torch.Tensor:
        """A graph's whole work: the step, and with head its greedy tokens, each written to
        its row's entry of fed_tokens (padding rows write the pad entry)."""
        hidden = self._step(b, seq_lens)
        if not head:
            return hidden
        tokens = self.greedy_head(hidden)
        self.fed_tokens.index_copy_(0, self.inputs.views["rows"][:b], tokens)
        return tokens

    def run(self, staged: StagedDecode, x, head: bool = False) -> torch.Tensor:
        """Replay the graph of staged.b on the staged inputs (x: the activations, off the
        first rank): rows [0, n) of its hidden states, or with head (the last rank, every
        row greedy) of its greedy tokens, already in fed_tokens. The output is cloned: the
        next replay rewrites it."""
        n, b = staged.n, staged.b
        if head and self.greedy_head is None:
            raise ValueError("head: these graphs were made without a greedy head")
        if not self.is_first:
            with phase("graph inputs"):
                self.x[:n].copy_(x)
        if not self.capture:  # CPU tests: the same work, eagerly (host lists for the CPU kernel)
            return self._work(b, head, self.inputs.views["ctx"][:b].tolist())[:n].clone()
        graph, out = self.graphs[(b, head)]
        with phase("graph replay"):
            graph.replay()
        with phase("graph output"):
            return out[:n].clone()
