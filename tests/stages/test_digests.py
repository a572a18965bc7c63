"""The ranks' running digest hashes: moved by each step's new tokens, they must equal the full
recompute from the row's contents after every step of a real workload (chunked prefill,
staggered finishes, slot reuse, overlapped steps, seeded sampling), and a corrupted cell that
no write path saw is invisible to them until the next full recompute."""
from __future__ import annotations

import numpy as np
import pytest

from ray_runtime.messages import CachedRequestData, NewRequestData, StepPlan
from ray_runtime.sampling_params import SamplingParams
from stages.input_batch import InputBatch
from tests.conftest import stress_workload
from tests.stages.test_overlap import _run


def test_running_hash_equals_full_recompute_every_step(tiny_model, monkeypatch):
    compared = []
    real = InputBatch.digests_of

    def both(self, view, full=False, full_every=0):
        incremental = real(self, view)
        recomputed = real(self, view, full=True)
        assert incremental == recomputed, f"after {len(compared)} steps: running hash drifted"
        compared.append(len(incremental))
        return incremental

    monkeypatch.setattr(InputBatch, "digests_of", both)
    prompts, budgets = stress_workload(seed=43, num_requests=12, max_len=100)
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.7, seed=i)
              for i, m in enumerate(budgets)]
    _run(tiny_model("qwen3"), prompts, params, overlapped=True)
    assert len(compared) > 15 and sum(compared) > 60


def test_a_corrupted_cell_is_caught_by_the_full_recompute_only():
    b = InputBatch(2, 32, 16)
    new = NewRequestData("A", 1, list(range(10, 20)), 10, 0, [1], SamplingParams())
    plan = StepPlan(0, [], [new], CachedRequestData(), ["A"], [10])
    b.apply_plan(plan)
    clean = b.digests(plan)[0].token_hash
    b.token_ids[0, 3] += 1  # behind every write path's back
    assert b.digests(plan)[0].token_hash == clean, "the running hash cannot see it"
    assert b.digests(plan, full=True)[0].token_hash != clean
    # and the running state now carries the recomputed (true) value
    assert b.digests(plan)[0].token_hash != clean
    assert b.hash_len[0] == 10 and b.hash_val[0] != np.uint64(0)


@pytest.mark.parametrize("longest", [0, 1, 5])
def test_a_span_moves_a_hash_from_its_start_to_its_end(longest):
    """spans_hash_delta(start, end) = rows_hash(end) - rows_hash(start) (mod 2**64), for
    spans of at most `longest` tokens (1: a decode step's, which takes its own path)."""
    from ray_runtime.digest import rows_hash, spans_hash_delta

    rng = np.random.default_rng(longest)
    tokens = rng.integers(0, 150_000, (12, 40))
    rows = rng.permutation(12)[:9]
    start = rng.integers(0, 30, 9)
    end = start + rng.integers(0, longest + 1, 9)
    with np.errstate(over="ignore"):
        want = rows_hash(tokens, rows, end) - rows_hash(tokens, rows, start)
    assert spans_hash_delta(tokens, rows, start, end).tolist() == want.tolist()
