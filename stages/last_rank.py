"""The last rank's half of a step: logits, sampling (kept on the device when it can be), draft
verification and proposal. The device buffer of each slot's latest sample lives here, with
the pinned host buffers its values reach the host through."""
from __future__ import annotations

import torch

from ray_runtime.config import EngineConfig
from ray_runtime.messages import SamplerOutput
from ray_runtime.sampling_params import SamplingParams
from stages.draft_model import DraftModelProposer
from stages.input_batch import InputBatch
from stages.model_spec import ModelSpec
from stages.ngram_proposer import ngram_propose
from stages.sampler import Sampler, token_logprobs
from stages.spec_sampler import SpecVerifier
from stages.step_types import DeferredSamples, LaunchedStep, StepInputs


class LastRank:
    def __init__(self, config: EngineConfig, spec: ModelSpec, model, batch: InputBatch) -> None:
        self.device = config.device
        self.model, self.batch = model, batch
        self.sampler = Sampler(torch.device(self.device))
        self.spec_config = config.speculative_config
        self.verifier = SpecVerifier(torch.device(self.device), self.sampler.unseeded) \
            if self.spec_config else None
        self.drafter = DraftModelProposer(config, spec, self.sampler.unseeded) \
            if self.verifier and self.spec_config.method == "draft_model" else None
        # [max_num_seqs] each slot's latest sample, written by the device; read only for a
        # slot with a pending sample, which only its current tenant can have (invariant 3).
        self.last_sampled = torch.zeros(config.max_num_seqs, dtype=torch.long, device=self.device)
        # Two pinned host buffers, alternating by step: a copy still in flight is never
        # overwritten by the next step's (invariant 2).
        self._pinned_tokens = [torch.zeros(config.max_num_seqs, dtype=torch.long,
                                           pin_memory=self.device == "cuda") for _ in range(2)]

    def sample_step(self, step_id: int, hidden: torch.Tensor, inputs: StepInputs,
                    step: LaunchedStep) -> None:
        """Sample the step's requests: on the device (deferred) when nothing on the host
        needs the tokens now; otherwise at once, folded into the batch, with next drafts."""
        params = [self.batch.sampling[r] for r in inputs.sample_slots.tolist()]
        if self._can_defer(params):
            self._sample_deferred(hidden, inputs, params, step)
            return
        out = self._sample(step_id, hidden, inputs)
        # The last rank holds its samples at once: with PP=1 the next plan may already
        # compute on them before the driver has seen them (placeholders).
        self.batch.append_samples(out.req_ids, out.sampled_token_ids)
        if self.spec_config is not None:
            out.draft_token_ids = self._propose(out.req_ids)
        step.sampler_output = out

    def _can_defer(self, params: list[SamplingParams]) -> bool:
        """Whether the step's samples (params: each sampled request's) may stay on the device
        until finish: not when drafts are verified or proposed (host logic on the tokens),
        nor for logprobs."""
        if self.spec_config is not None or not params:
            return False
        return not any(sp.logprobs is not None for sp in params)

    def _sample_deferred(self, hidden: torch.Tensor, inputs: StepInputs,
                         params: list[SamplingParams], step: LaunchedStep) -> None:
        b = self.batch
        logits = self.model.compute_logits(hidden.index_select(0, inputs.device.sample_token_index))
        tokens = self.sampler.sample(logits, params, inputs.sample_output_index)
        slots = inputs.sample_slots
        self.last_sampled[inputs.device.sample_slots] = tokens
        n = len(slots)
        if self.device == "cuda":
            host = self._pinned_tokens[step.step_id % 2][:n]  # double-buffered (invariant 2)
            host.copy_(tokens, non_blocking=True)
            step.tokens_ready = torch.cuda.Event()
            step.tokens_ready.record()
        else:
            host = tokens
        step.deferred = DeferredSamples(req_ids=inputs.sample_req_ids, slots=slots,
                                        generations=b.expect_samples(slots),
                                        incarnations=b.incarnation[slots].tolist(), tokens=host)

    def _sample(self, step_id: int, hidden: torch.Tensor, inputs: StepInputs) -> SamplerOutput:
        b = self.batch
        rows = [b.req_id_to_slot[r] for r in inputs.sample_req_ids]
        if not rows:
            return SamplerOutput(step_id=step_id, req_ids=[], incarnations=[], sampled_token_ids=[])
        # Each request's last 1 + m positions: its last known token and its m drafts.
        counts = [m + 1 for m in inputs.sample_num_drafts]
        index = torch.tensor([i for last, n in zip(inputs.sample_token_index, counts)
                              for i in range(last - n + 1, last + 1)], device=hidden.device)
        all_logits = self.model.compute_logits(hidden.index_select(0, index))
        params = [b.sampling[r] for r in rows]
        plain = [i for i, m in enumerate(inputs.sample_num_drafts) if m == 0]
        spec = [i for i, m in enumerate(inputs.sample_num_drafts) if m > 0]
        wants_logprobs = any(sp.logprobs is not None for sp in params)
        # Per-request views only where something reads them per request.
        logits = all_logits.split(counts) if spec or wants_logprobs else None
        tokens: list[list[int]] = [[] for _ in rows]
        if plain:  # logprobs: below, for every emitted token at once
            plain_logits = all_logits if not spec else torch.cat([logits[i] for i in plain])
            res = self.sampler(plain_logits, [params[i] for i in plain],
                               [inputs.sample_output_index[i] for i in plain], with_logprobs=False)
            for i, t in zip(plain, res.token_ids):
                tokens[i] = [t]
        if spec:
            drafts = [b.drafts(inputs.sample_req_ids[i]) for i in spec]
            q = None if self.drafter is None else [
                self.drafter.draft_probs(inputs.sample_req_ids[i], int(b.incarnation[rows[i]]), d)
                for i, d in zip(spec, drafts)]
            emitted = self.verifier([logits[i] for i in spec], drafts, [params[i] for i in spec],
                                    [inputs.sample_output_index[i] for i in spec], q)
            for i, t in zip(spec, emitted):
                tokens[i] = t
        out = SamplerOutput(
            step_id=step_id, req_ids=inputs.sample_req_ids,
            incarnations=[int(b.incarnation[r]) for r in rows], sampled_token_ids=tokens,
            num_draft_tokens=list(inputs.sample_num_drafts) if self.spec_config else None)
        if wants_logprobs:
            self._attach_logprobs(out, logits, params)
        return out

    @staticmethod
    def _attach_logprobs(out: SamplerOutput, logits: list[torch.Tensor],
                         params: list[SamplingParams]) -> None:
        """Per request, an entry for each emitted token: emitted token j was predicted at
        the request's j-th sampled position (its last known token, then its drafts)."""
        ids, vals, ranks = [], [], []
        for lg, toks, sp in zip(logits, out.sampled_token_ids, params):
            entries = [] if sp.logprobs is None else [
                token_logprobs(row, t, sp.logprobs)
                for row, t in zip(torch.log_softmax(lg[:len(toks)], dim=-1), toks)]
            ids.append([e[0] for e in entries])
            vals.append([e[1] for e in entries])
            ranks.append([e[2] for e in entries])
        out.logprob_token_ids, out.logprobs, out.num_logprob_ranks = ids, vals, ranks

    def _propose(self, req_ids: list[str]) -> list[list[int]]:
        """Drafts for each request's next step, placed in its row (the first stage reads
        them there at PP=1; the driver forwards them at PP>1)."""
        b, spec = self.batch, self.spec_config
        rows = [b.req_id_to_slot[r] for r in req_ids]
        known = [int(b.num_tokens_known[row]) for row in rows]
        first_output = [n - int(b.num_prompt_tokens[row]) for n, row in zip(known, rows)]
        # Never draft past max_tokens (the step emits at most m + 1) or the context.
        caps = [max(0, min(spec.num_speculative_tokens, b.sampling[row].max_tokens - out - 1,
                           b.max_model_len - 1 - n))
                for row, n, out in zip(rows, known, first_output)]
        if self.drafter is not None:
            drafts = self.drafter.propose(b, req_ids, caps, first_output)
        else:
            drafts = [ngram_propose(b.token_ids[row, :n], k, spec.prompt_lookup_min,
                                    spec.prompt_lookup_max) if k > 0 else []
                      for row, n, k in zip(rows, known, caps)]
        for req_id, d in zip(req_ids, drafts):
            b.set_drafts(req_id, d)
        return drafts
