"""Drafts from a smaller model with the same vocabulary, run on the last rank.

The draft model keeps its own paged KV pool with the same number of blocks as the target's,
indexed by the same block table: the driver reserves `num_speculative_tokens` slots past
every step for the drafts' KV. Per row, `num_draft_computed` is the prefix whose draft KV is
valid; each proposal first catches the draft up to the row's known prefix (the whole prompt
the first time), then decodes k tokens one at a time. Only the known prefix counts as
computed afterwards: the drafts' own KV is rewritten on the next catch-up.

For a sampled request the draft token is drawn from the draft's distribution q (after the
request's temperature and filters), and q is kept, keyed by request id and incarnation
(never by row), for the rejection sampler of the next step.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ray_runtime.config import EngineConfig
from ray_runtime.layer_span import LayerSpan
from stages.input_batch import InputBatch
from stages.kv_cache import allocate_kv_cache, bytes_per_block
from stages.model import attention_metadata, build_stage
from stages.model_spec import ModelSpec
from stages.sampler import apply_filters, seeded_generator

_DRAFT_SEED_SALT = 0xD7AF_7000


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target: ModelSpec, unseeded: torch.Generator,
                 max_positions: Optional[int] = None) -> None:
        self.spec = ModelSpec.from_dir(config.speculative_config.model)
        if self.spec.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocab_size "
                             f"{self.spec.vocab_size} differs from the target's {target.vocab_size}")
        self.dtype = getattr(torch, config.dtype)
        self.device = config.device
        self.block_size = config.block_size
        # its positions are the target's requests': its rope tables cover the target's
        # max_model_len, whatever its own checkpoint's context
        self.model = build_stage(self.spec, LayerSpan.of_layers(0, self.spec.num_layers), True, True,
                                 self.dtype, self.device, max_positions=max_positions)
        self.kv_caches: list = []
        self._unseeded = unseeded
        # req_id -> (incarnation, drafts, q [m, V]) for sampled (non-greedy) requests
        self._draft_probs: dict[str, tuple[int, list[int], torch.Tensor]] = {}

    def bytes_per_block(self) -> int:
        return bytes_per_block(self.spec, self.spec.num_layers, self.block_size, self.dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.spec, self.spec.num_layers, num_blocks,
                                           self.block_size, self.dtype, self.device)

    def forget(self, req_id: str) -> None:
        self._draft_probs.pop(req_id, None)

    def draft_probs(self, req_id: str, incarnation: int, drafts: list[int]) -> Optional[torch.Tensor]:
        """q for the drafts a step verifies; they may be a prefix of the proposal (the driver
        trims drafts to its token budget)."""
        entry = self._draft_probs.get(req_id)
        if entry is None:
            return None
        inc, proposed, q = entry
        if inc != incarnation or proposed[:len(drafts)] != drafts:
            raise AssertionError(f"request {req_id!r}: verifying drafts {drafts} but the draft "
                                 f"model proposed {proposed} (incarnation {inc} vs {incarnation})")
        return q[:len(drafts)]

    @torch.inference_mode()
    def propose(self, batch: InputBatch, req_ids: list[str], caps: list[int],
                output_indices: list[int]) -> list[list[int]]:
        """Up to caps[i] drafts for each request; output_indices[i]: the output index of the
        first draft (for seeded sampling)."""
        drafts: list[list[int]] = [[] for _ in req_ids]
        live = [i for i, k in enumerate(caps) if k > 0]
        for r in req_ids:
            self.forget(r)
        if not live:
            return drafts
        rows = np.array([batch.req_id_to_slot[req_ids[i]] for i in live], np.int64)
        known = batch.num_tokens_known[rows].copy()
        # The drafts' KV goes up to position known + cap - 2: inside the driver's lookahead.
        reach = known + np.array([caps[i] for i in live]) - 1
        if (reach > batch.num_blocks[rows] * self.block_size).any():
            raise AssertionError("draft model KV would pass a row's blocks: the lookahead is short")
        done = batch.num_draft_computed[rows].copy()
        # Catch up: every known token the draft has not seen yet, in one mixed batch.
        num_new = known - done
        assert (num_new > 0).all(), "draft catch-up with nothing to catch up"
        meta, token_row, positions, _ = attention_metadata(batch.block_table, rows, done, num_new,
                                                        self.block_size, self.device)
        ids = torch.from_numpy(batch.token_ids[token_row, positions]).to(self.device)
        hidden = self.model(ids, meta, self.kv_caches)
        last = torch.tensor(meta.query_start_loc[1:], device=hidden.device) - 1
        logits = self.model.compute_logits(hidden.index_select(0, last))
        batch.num_draft_computed[rows] = known
        params = [batch.sampling[r] for r in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in live]
        active = list(range(len(live)))
        for j in range(max(caps[i] for i in live)):
            tokens = self._pick(logits, [params[a] for a in active],
                                [output_indices[live[a]] + j for a in active],
                                [qs[a] for a in active])
            for a, t in zip(active, tokens):
                drafts[live[a]].append(t)
            active = [a for a in active if caps[live[a]] > j + 1]
            if not active:
                break
            sel = np.array(active)
            step_rows = rows[sel]
            meta, _, _, _ = attention_metadata(batch.block_table, step_rows, known[sel] + j,
                                        np.ones(len(sel), np.int64), self.block_size, self.device)
            ids = torch.tensor([drafts[live[a]][-1] for a in active], device=self.device)
            hidden = self.model(ids, meta, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        for a, i in enumerate(live):
            if not params[a].is_greedy:
                self._draft_probs[req_ids[i]] = (int(batch.incarnation[rows[a]]), drafts[i],
                                                 torch.stack(qs[a]))
        return drafts

    def _pick(self, logits: torch.Tensor, params, output_indices: list[int],
              q_out: list[list[torch.Tensor]]) -> list[int]:
        tokens = torch.argmax(logits, dim=-1).tolist()
        for i, sp in enumerate(params):
            if sp.is_greedy:
                continue
            q = torch.softmax(apply_filters(logits[i], sp), dim=-1)
            gen = self._unseeded if sp.seed is None else \
                seeded_generator(sp.seed ^ _DRAFT_SEED_SALT, output_indices[i], logits.device)
            tokens[i] = int(torch.multinomial(q, 1, generator=gen)[0])
            q_out[i].append(q)
        return tokens
