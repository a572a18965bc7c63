"""The penalty function on hand-made logits (stages/penalties.py): vLLM's formulas, exact
values, tokens outside the history untouched bit for bit, the input left alone."""
import numpy as np
import pytest
import torch

from ray_runtime.sampling_params import SamplingParams
from stages.penalties import apply_penalties

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]


def ids(*xs):
    return np.array(xs, np.int64)


def test_hand_computed_values():
    logits = torch.tensor([LOGITS, LOGITS])
    before = logits.clone()
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [ids(0, 1), ids(0, 1)], [ids(3, 3, 4), ids(3, 3, 4)],
                          [sp, SamplingParams()])
    # token 0, 1: prompt only -> repetition (2 / 2, -1 * 2); token 3: output twice ->
    # 3 / 2 - 0.5 * 2 - 0.25; token 4: output once -> -2 * 2 - 0.5 - 0.25; 2 and 5 untouched.
    assert out[0].tolist() == [1.0, -2.0, 0.5, 0.25, -4.75, 0.0]
    assert torch.equal(out[1], before[1])  # a row with no penalties is unchanged
    assert torch.equal(logits, before)  # logprobs read the raw logits: no in-place change


@pytest.mark.parametrize("sp,expected", [
    (SamplingParams(repetition_penalty=0.5), [4.0, -0.5, 0.5, 6.0, -1.0, 0.0]),  # < 1 favours
    (SamplingParams(frequency_penalty=-1.0), [2.0, -1.0, 0.5, 5.0, -1.0, 0.0]),  # prompt: no
    (SamplingParams(presence_penalty=1.5), [2.0, -1.0, 0.5, 1.5, -3.5, 0.0]),  # once per token
])
def test_each_penalty_alone(sp, expected):
    out = apply_penalties(torch.tensor([LOGITS]), [ids(0, 1)], [ids(3, 3, 4)], [sp])
    assert out[0].tolist() == expected


def test_empty_output_only_repetition_applies():
    """The first output token: frequency and presence have nothing to count yet."""
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0)
    out = apply_penalties(torch.tensor([LOGITS]), [ids(3, 4, 3)], [ids()], [sp])
    assert out[0].tolist() == [2.0, -1.0, 0.5, 1.5, -4.0, 0.0]


def test_repetition_equals_hf_processor():
    """HF's RepetitionPenaltyLogitsProcessor on the whole sequence (prompt + output), random
    logits with both signs: equal bit for bit."""
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 4
    seqs = [torch.randint(0, 50, (n,), generator=gen) for n in (5, 12, 1)]
    split = [2, 7, 1]  # prompt length of each row
    for r in (0.3, 1.0, 1.7):
        sp = SamplingParams(repetition_penalty=r)
        ours = apply_penalties(logits, [s[:k].numpy() for s, k in zip(seqs, split)],
                               [s[k:].numpy() for s, k in zip(seqs, split)], [sp] * 3)
        for i, s in enumerate(seqs):
            hf = RepetitionPenaltyLogitsProcessor(r)(s[None], logits[i:i + 1].clone())
            assert torch.equal(ours[i], hf[0]), r


def test_greedy_choice_moves_off_a_repeated_token():
    """The point of it: argmax after penalties avoids the output's repeated token."""
    sp = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    out = apply_penalties(torch.tensor([LOGITS]), [ids(0)], [ids(3, 3)], [sp])
    assert int(torch.argmax(torch.tensor([LOGITS]))) == 3 and int(torch.argmax(out)) == 0


def test_history_outside_the_vocabulary_is_refused():
    with pytest.raises(AssertionError, match="outside"):
        apply_penalties(torch.tensor([LOGITS]), [ids(0)], [ids(-1)],
                        [SamplingParams(presence_penalty=1.0)])
