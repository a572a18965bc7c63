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


def test_only_penalized_steps_leave_the_device_path():
    """A step whose sampled requests use no penalties keeps its samples on the device (the
    deferred path): requests without penalties pay nothing for the feature."""
    from types import SimpleNamespace

    import numpy as np

    from stages.last_rank import LastRank

    params = [SamplingParams(), SamplingParams(temperature=0.0, top_k=3),
              SamplingParams(repetition_penalty=1.1), SamplingParams(frequency_penalty=-0.1),
              SamplingParams(temperature=0.0, logprobs=2)]
    b = _batch_with([(f"r{i}", [3, 4], [], [], sp) for i, sp in enumerate(params)], 8)
    b.check()  # the per-row flags agree with each row's SamplingParams
    slot = [b.req_id_to_slot[f"r{i}"] for i in range(len(params))]
    rank = SimpleNamespace(spec_config=None, batch=b)
    assert LastRank._can_defer(rank, np.array(slot[:2]))
    for other in slot[2:]:
        assert not LastRank._can_defer(rank, np.array(slot[:2] + [other]))
    assert not LastRank._can_defer(rank, np.array([], np.int64))
    assert not LastRank._can_defer(SimpleNamespace(spec_config=object(), batch=b), np.array(slot[:2]))


def _batch_with(requests, max_num_seqs=4):
    """An InputBatch holding (req_id, prompt, output, drafts, params) rows."""
    from ray_runtime.messages import NewRequestData
    from stages.input_batch import InputBatch

    b = InputBatch(max_num_seqs=max_num_seqs, max_model_len=32, block_size=4)
    for req_id, prompt, output, drafts, sp in requests:
        b.add(NewRequestData(req_id=req_id, incarnation=0, token_ids=prompt + output,
                             num_prompt_tokens=len(prompt), num_computed_tokens=0,
                             block_ids=list(range(8)), sampling=sp))
        b.set_drafts(req_id, drafts)
    return b


def test_verified_positions_count_the_drafts_before_them():
    """LastRank._penalize on a step's logits rows: request "a" verifies 2 drafts (3 rows),
    row j penalized with the output plus drafts[:j]; "b" (no penalties) is left alone; "c"
    has no drafts. Rows are laid out request after request."""
    from types import SimpleNamespace

    from stages.last_rank import LastRank

    freq = SamplingParams(frequency_penalty=1.0)
    b = _batch_with([("a", [5, 6, 7], [8, 9], [7, 7], freq),
                     ("b", [5], [5], [], SamplingParams()),
                     ("c", [1, 2], [3, 3], [], SamplingParams(presence_penalty=0.5))])
    rows = [b.req_id_to_slot[r] for r in "abc"]
    params = [b.sampling[r] for r in rows]
    inputs = SimpleNamespace(sample_req_ids=list("abc"), sample_output_index=[2, 1, 2])
    logits = torch.zeros(5, 12)
    out = LastRank._penalize(SimpleNamespace(batch=b), logits, inputs, rows, [3, 1, 1], params,
                             [0, 2])
    expected = torch.zeros(5, 12)
    expected[0:3, [8, 9]] = -1.0  # the output, at every verified position
    expected[1, 7] = -1.0  # after drafts[:1] = [7]
    expected[2, 7] = -2.0  # after drafts[:2] = [7, 7]
    expected[4, 3] = -0.5  # "c": presence of its output token
    assert torch.equal(out, expected)
    assert not logits.any()  # the raw logits are untouched


def test_penalized_row_with_a_pending_sample_is_refused():
    """The host path relies on a penalized request's row holding its whole history: a pending
    (device-only) sample there is a bookkeeping bug, raised rather than sampled around."""
    from types import SimpleNamespace

    from stages.last_rank import LastRank

    sp = SamplingParams(presence_penalty=1.0)
    b = _batch_with([("a", [5, 6], [7], [], sp)])
    row = b.req_id_to_slot["a"]
    b.expect_samples(np.array([row]))
    inputs = SimpleNamespace(sample_req_ids=["a"], sample_output_index=[2])
    with pytest.raises(AssertionError, match="pending"):
        LastRank._penalize(SimpleNamespace(batch=b), torch.zeros(1, 12), inputs, [row], [1],
                           [sp], [0])
