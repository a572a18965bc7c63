"""The records of one step on a rank: its inputs (host and device), and a launched step
waiting to be finished."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ray_runtime.messages import RowDigests, SamplerOutput
from stages.graph_inputs import StagedDecode
from stages.model import AttentionMetadata


@dataclass
class StepInputs:
    rows: np.ndarray  # the batch row of each scheduled request
    num_new: np.ndarray  # tokens each scheduled request runs (the plan's, or fewer if self-drafted)
    meta: Optional[AttentionMetadata]
    # The sampled requests' host lists, built on the last rank only (None elsewhere):
    sample_req_ids: list[str]  # requests whose known prefix this step completes
    sample_token_index: list[int]  # their last token's index in the step's layout
    sample_output_index: list[int]  # index of the output token each will sample (0 = first)
    sample_num_drafts: list[int]  # drafts each verifies: its last 1 + m tokens get logits
    sample_slots: np.ndarray  # [num_sampled] their slots
    # Tokens whose id is a pending sample (still only on the device): their index in the
    # step's layout and their slot, for the device-side patch of the input ids.
    patch_index: np.ndarray
    patch_slot: np.ndarray
    num_tokens: int
    device: "DeviceInputs"
    # every token is a sampled request's last one (a decode step): the hidden states are the
    # sampler's rows as they are, with no index_select
    samples_every_token: bool = False
    # a decode step staged for its graph (stages/graph_inputs.py): meta is None then, and
    # of the device inputs only sample_slots is set
    staged: Optional[StagedDecode] = None
    # the plan's: an eager step that runs the prefill split's blocks (never staged)
    prefill_shaped: bool = False


@dataclass
class DeviceInputs:
    """The step's own arrays on the device, staged with its attention metadata (one copy)."""

    token_ids: Optional[torch.Tensor]  # [num_tokens] first rank; empty elsewhere
    patch_index: Optional[torch.Tensor]
    patch_slot: Optional[torch.Tensor]
    sample_token_index: Optional[torch.Tensor]  # [num_sampled]
    sample_slots: torch.Tensor  # [num_sampled]


@dataclass
class DeferredSamples:
    """A step's samples on their way to the host (one pinned copy, one event)."""

    req_ids: list[str]
    slots: np.ndarray  # [n]
    generations: np.ndarray  # [n] the slots' generations at launch: a changed one drops its value
    incarnations: list[int]
    tokens: torch.Tensor  # [n] host (pinned on CUDA), valid once the step's event completed
    on_device: torch.Tensor  # [n] the samples where they were made (the token feedback's source)


@dataclass
class LaunchedStep:
    step_id: int
    start: float
    recv_done: float
    digests: RowDigests
    digest_s: float
    gpu_start: Optional[torch.cuda.Event]
    gpu_end: Optional[torch.cuda.Event] = None
    compute_done: float = 0.0
    sampler_output: Optional[SamplerOutput] = None  # ready at launch (the host-side paths)
    deferred: Optional[DeferredSamples] = None
    tokens_ready: Optional[torch.cuda.Event] = None
    token_wait_s: float = 0.0  # rank 0, host path: waiting for the fed-back tokens
    fed_from: int = -1  # rank 0: the newest step whose fed-back samples this one waits for
