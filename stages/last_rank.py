"""The last rank's half of a step: logits, sampling (kept on the device when it can be), draft
verification and proposal. The device buffer of each slot's latest sample lives here, with
the pinned host buffers its values reach the host through."""
from __future__ import annotations

import numpy as np
import torch

from ray_runtime.config import EngineConfig
from ray_runtime.messages import SamplerOutput
from ray_runtime.sampling_params import SamplingParams
from stages import profiling
from stages.draft_model import DraftModelProposer
from stages.input_batch import InputBatch
from stages.model_spec import ModelSpec
from stages.ngram_proposer import ngram_propose
from stages.penalties import apply_penalties
from stages.pinned_ring import PinnedRing
from stages.sampler import Sampler, token_logprobs
from stages.spec_sampler import SpecVerifier
from stages.step_types import DeferredSamples, LaunchedStep, StepInputs


class LastRank:
    def __init__(self, config: EngineConfig, spec: ModelSpec, model, batch: InputBatch,
                 last_sampled: torch.Tensor) -> None:
        self.device = config.device
        self.model, self.batch = model, batch
        self.sampler = Sampler(torch.device(self.device))
        self.spec_config = config.speculative_config
        self.verifier = SpecVerifier(torch.device(self.device), self.sampler.unseeded) \
            if self.spec_config else None
        self.drafter = DraftModelProposer(config, spec, self.sampler.unseeded,
                                          max_positions=batch.max_model_len) \
            if self.verifier and self.spec_config.method == "draft_model" else None
        # [>= max_num_seqs] each slot's latest sample, written by the device (the runner's
        # buffer: at PP=1 the first rank's fed ids read it); read only for a slot with a
        # pending sample, which only its current tenant can have (invariant 3).
        self.last_sampled = last_sampled
        # Host copies of the samples, one more than the steps this rank keeps in flight (the
        # step loop's limit): a copy not yet read by its step's finish is never overwritten.
        self._pinned_tokens = PinnedRing(config.inflight_steps + 1, config.max_num_seqs,
                                         torch.long, pin=True) if self.device == "cuda" else None

    def sample_step(self, step_id: int, hidden: torch.Tensor, inputs: StepInputs,
                    step: LaunchedStep) -> None:
        """Sample the step's requests: on the device (deferred) when nothing on the host
        needs the tokens now; otherwise at once, folded into the batch, with next drafts."""
        if self._can_defer(inputs.sample_slots):
            self._sample_deferred(hidden, inputs, step)
            return
        # The host needs these tokens now (drafts to verify and propose, the history that
        # penalties read, logprobs): the one place a step waits for its device on purpose
        # (docs/invariants.md 6).
        with profiling.sync_allowed():
            out = self._sample(step_id, hidden, inputs)
            # The last rank holds its samples at once: with PP=1 the next plan may already
            # compute on them before the driver has seen them (placeholders).
            self.batch.append_samples(out.req_ids, out.sampled_token_ids)
            if self.spec_config is not None:
                out.draft_token_ids = self._propose(out.req_ids)
        step.sampler_output = out

    def _can_defer(self, slots: np.ndarray) -> bool:
        """Whether the step's samples (slots: the sampled rows) may stay on the device until
        finish: not when drafts are verified or proposed (host logic on the tokens), nor for
        logprobs, nor for penalties (they read the token history, which a deferred sample
        would leave one token short on the host): SamplingParams.needs_host_sample."""
        if self.spec_config is not None or not len(slots):
            return False
        return not self.batch.needs_host_sample[slots].any()

    def _sample_deferred(self, hidden: torch.Tensor, inputs: StepInputs,
                         step: LaunchedStep) -> None:
        b = self.batch
        slots = inputs.sample_slots
        greedy = bool(b.greedy[slots].all())
        rows = hidden if inputs.samples_every_token else \
            hidden.index_select(0, inputs.device.sample_token_index)
        if greedy:  # no SamplingParams read: an argmax in the model's dtype
            tokens = self.greedy_tokens(rows)
        else:
            params = [b.sampling[r] for r in slots.tolist()]
            tokens = self.sampler.sample(self.model.compute_logits(rows), params,
                                         inputs.sample_output_index)
        self.last_sampled[inputs.device.sample_slots] = tokens
        self.defer(tokens, inputs, step)

    def samples_in_graph(self, inputs: StepInputs) -> bool:
        """Whether a staged decode step's samples can come from its graph's greedy head
        (stages/cuda_graphs.py): every sampled row greedy, and nothing on the host needs
        them before finish (_can_defer)."""
        slots = inputs.sample_slots
        return (inputs.staged is not None and self._can_defer(slots)
                and bool(self.batch.greedy[slots].all()))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy head a decode graph ends in: every row's argmax, in the model's dtype."""
        return self.sampler.greedy(self.model.compute_logits(hidden, upcast=False))

    def defer(self, tokens: torch.Tensor, inputs: StepInputs, step: LaunchedStep) -> None:
        """The step's samples (on the device, already in last_sampled) on their way to the
        host: one pinned copy and one event, read in finish."""
        b = self.batch
        slots = inputs.sample_slots
        n = len(slots)
        if self.device == "cuda":
            host = self._pinned_tokens.next(n)  # a ring (invariant 2)
            host.copy_(tokens, non_blocking=True)
            step.tokens_ready = torch.cuda.Event()
            step.tokens_ready.record()
        else:
            host = tokens
        step.deferred = DeferredSamples(req_ids=inputs.sample_req_ids, slots=slots,
                                        generations=b.expect_samples(slots),
                                        incarnations=b.incarnation[slots].tolist(), tokens=host,
                                        on_device=tokens)

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
        penalized = [i for i, sp in enumerate(params) if sp.uses_penalties]
        # Sampling and verification read the penalized logits; logprobs the raw ones.
        sample_logits = all_logits if not penalized else \
            self._penalize(all_logits, inputs, rows, counts, params, penalized)
        # Per-request views only where something reads them per request.
        logits = all_logits.split(counts) if wants_logprobs else None
        split = sample_logits.split(counts) if spec else None
        tokens: list[list[int]] = [[] for _ in rows]
        if plain:  # logprobs: below, for every emitted token at once
            plain_logits = sample_logits if not spec else torch.cat([split[i] for i in plain])
            res = self.sampler(plain_logits, [params[i] for i in plain],
                               [inputs.sample_output_index[i] for i in plain], with_logprobs=False)
            for i, t in zip(plain, res.token_ids):
                tokens[i] = [t]
        if spec:
            drafts = [b.drafts(inputs.sample_req_ids[i]) for i in spec]
            q = None if self.drafter is None else [
                self.drafter.draft_probs(inputs.sample_req_ids[i], int(b.incarnation[rows[i]]), d)
                for i, d in zip(spec, drafts)]
            emitted = self.verifier([split[i] for i in spec], drafts, [params[i] for i in spec],
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

    def _penalize(self, all_logits: torch.Tensor, inputs: StepInputs, rows: list[int],
                  counts: list[int], params: list[SamplingParams],
                  penalized: list[int]) -> torch.Tensor:
        """all_logits with the penalties applied to the rows of the requests in `penalized`.
        Each logits row is predicted after the request's known prefix plus the drafts before
        it: row j of a request that verifies m drafts counts drafts[:j] as output (a verified
        position is used only if those drafts were accepted)."""
        b = self.batch
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        index, prompts, outputs, row_params = [], [], [], []
        for i in penalized:
            slot = rows[i]
            num_prompt = int(b.num_prompt_tokens[slot])
            known = num_prompt + inputs.sample_output_index[i]
            # A penalized request never defers its samples (_can_defer), so its row holds its
            # whole history on the host (invariant 1); anything else is a bookkeeping bug.
            if b.num_pending_samples[slot] or int(b.num_tokens_known[slot]) != known:
                raise AssertionError(
                    f"penalties for {inputs.sample_req_ids[i]!r}: the row knows "
                    f"{int(b.num_tokens_known[slot])} tokens (+{int(b.num_pending_samples[slot])} "
                    f"pending), the sample follows {known}")
            prompt = b.token_ids[slot, :num_prompt]
            output = b.token_ids[slot, num_prompt:known]
            drafts = np.asarray(b.drafts(inputs.sample_req_ids[i]) if counts[i] > 1 else [],
                                np.int64)
            assert len(drafts) == counts[i] - 1, "penalties: drafts and verified rows disagree"
            for j in range(counts[i]):
                index.append(offsets[i] + j)
                prompts.append(prompt)
                outputs.append(np.concatenate([output, drafts[:j]]) if j else output)
                row_params.append(params[i])
        index_t = torch.tensor(index, device=all_logits.device)
        penalized_rows = apply_penalties(all_logits.index_select(0, index_t), prompts, outputs,
                                         row_params)
        return all_logits.index_copy(0, index_t, penalized_rows)

    @staticmethod
    def _attach_logprobs(out: SamplerOutput, logits: list[torch.Tensor],
                         params: list[SamplingParams]) -> None:
        """Per request, an entry for each emitted token: emitted token j was predicted at
        the request's j-th sampled position (its last known token, then its drafts)."""
        rows, tokens, nums, counts = [], [], [], []
        for lg, toks, sp in zip(logits, out.sampled_token_ids, params):
            counts.append(0 if sp.logprobs is None else len(toks))
            if counts[-1]:
                rows.append(lg[:len(toks)])
                tokens += toks
                nums += [sp.logprobs] * len(toks)
        entries = token_logprobs(torch.log_softmax(torch.cat(rows), dim=-1), tokens, nums) \
            if rows else []
        ids, vals, ranks, at = [], [], [], 0
        for n in counts:
            ids.append([e[0] for e in entries[at:at + n]])
            vals.append([e[1] for e in entries[at:at + n]])
            ranks.append([e[2] for e in entries[at:at + n]])
            at += n
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
