"""stages/last_rank.py, in process on the CPU with a stand-in model: a deferred step asks the
model for logits in its own dtype only when every row is greedy (an argmax), in float32
as soon as one row samples, and lands each token on its own slot."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ray_runtime.messages import NewRequestData, RowDigests
from ray_runtime.sampling_params import SamplingParams
from stages.input_batch import InputBatch
from stages.last_rank import LastRank
from stages.step_types import LaunchedStep

VOCAB = 30


class _Model:
    """compute_logits records whether it was asked to upcast; logits favour token 7 + row."""

    def __init__(self) -> None:
        self.upcasts: list[bool] = []

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        self.upcasts.append(upcast)
        logits = torch.zeros(hidden.shape[0], VOCAB, dtype=torch.bfloat16)
        logits[torch.arange(hidden.shape[0]), 7 + torch.arange(hidden.shape[0])] = 50.0
        return logits.float() if upcast else logits


def _step(params: list[SamplingParams], every_token: bool = False
          ) -> tuple[LastRank, _Model, LaunchedStep, np.ndarray]:
    config = SimpleNamespace(device="cpu", speculative_config=None, max_num_seqs=4, inflight_steps=2)
    batch = InputBatch(4, 64, 16)
    for i, sp in enumerate(params):
        batch.add(NewRequestData(req_id=f"r{i}", incarnation=1, token_ids=[3, 4, 5],
                                 num_prompt_tokens=3, num_computed_tokens=0, block_ids=[1],
                                 sampling=sp))
    model = _Model()
    rank = LastRank(config, None, model, batch, torch.zeros(5, dtype=torch.long))
    slots = np.array([batch.req_id_to_slot[f"r{i}"] for i in range(len(params))])
    n = len(params)
    inputs = SimpleNamespace(sample_slots=slots, sample_req_ids=[f"r{i}" for i in range(n)],
                             sample_output_index=[0] * n, sample_token_index=list(range(n)),
                             sample_num_drafts=[0] * n, samples_every_token=every_token,
                             device=SimpleNamespace(sample_token_index=torch.arange(n),
                                                    sample_slots=torch.from_numpy(slots)))
    step = LaunchedStep(step_id=1, start=0.0, recv_done=0.0, digests=RowDigests(), digest_s=0.0, gpu_start=None)
    rank.sample_step(1, torch.zeros(n, 8), inputs, step)
    return rank, model, step, slots


@pytest.mark.parametrize("every_token", [False, True])  # True: no index_select of the rows
def test_all_greedy_step_takes_logits_in_the_model_dtype(every_token):
    rank, model, step, slots = _step([SamplingParams(temperature=0.0)] * 3, every_token)
    assert model.upcasts == [False]
    assert step.deferred is not None
    assert step.deferred.on_device.tolist() == [7, 8, 9]
    assert rank.last_sampled[torch.from_numpy(slots)].tolist() == [7, 8, 9]


def test_one_sampled_row_makes_the_step_take_float32_logits():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=3),
              SamplingParams(temperature=0.0)]
    rank, model, step, slots = _step(params)
    assert model.upcasts == [True]
    assert step.deferred.on_device.tolist() == [7, 8, 9]  # a logit gap of 50: the draw is sure
