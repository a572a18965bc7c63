"""Stage recovery: a stage whose process dies, or that stalls past step_timeout_s, is
replaced and every unfinished request recomputed from the driver's tokens. Nothing is lost:
greedy outputs equal the reference, seeded sampling gives the tokens of an undisturbed run,
and past max_stage_restarts the unfinished requests fail clearly while finished ones return."""
import random
import time

import pytest
import ray

from ray_runtime import LLM, SamplingParams
from ray_runtime.output_processor import RequestFailed
from tests.e2e import faults
from tests.reference import assert_matches, hf_greedy

N = 10


def _workload(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(5, 60))] for _ in range(N)]
    budgets = [rng.randint(2, 14) for _ in range(N)]
    return prompts, budgets


def _greedy(budgets):
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in budgets]


def _seeded(budgets):
    return [SamplingParams(max_tokens=m, temperature=0.9, top_p=0.95, seed=100 + i,
                           ignore_eos=True) for i, m in enumerate(budgets)]


def _ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def engine(ray_cluster, model):
    with LLM(model, pipeline_parallel_size=3, max_num_batched_tokens=32, max_num_seqs=6,
             step_timeout_s=8.0, max_stage_restarts=4) as llm:
        yield llm


def test_killed_stages_and_a_stall_are_replaced_and_nothing_is_lost(engine, model):
    """PP=3: kill rank 0, then 1, then 2 at random steps (one call each), then stall rank 1
    past the step deadline: every call returns every request, equal to the reference."""
    undisturbed_prompts, budgets0 = _workload(99)
    seeded_ref = _ids(engine.generate([{"prompt_token_ids": p} for p in undisturbed_prompts],
                                      _seeded(budgets0)))
    restarts = engine.stats()["num_stage_restarts"]
    plan = [(0, faults.ExitAtStep), (1, faults.ExitAtStep), (2, faults.ExitAtStep),
            (1, faults.StallAtStep)]
    for k, (rank, hook_cls) in enumerate(plan):
        rng = random.Random(k)
        step = engine.stats()["num_steps"] + rng.randint(2, 10)
        hook = hook_cls(step) if hook_cls is faults.ExitAtStep else hook_cls(step, 30.0)
        engine._set_fault_hook(rank, hook)
        prompts, budgets = _workload(k)
        t0 = time.monotonic()
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], _greedy(budgets))
        took = time.monotonic() - t0
        stats = engine.stats()
        assert stats["num_stage_restarts"] == restarts + 1, (k, stats["num_stage_restarts"])
        restarts += 1
        for i, (o, p, m) in enumerate(zip(outs, prompts, budgets)):
            assert o.outputs[0].finish_reason == "length"
            assert_matches(list(o.outputs[0].token_ids), hf_greedy(model, tuple(p), m),
                           f"fault {k} (rank {rank}) request {i}")
        assert took < 60, f"recovery took {took:.1f}s"
    # seeded sampling across a replacement: the undisturbed run's tokens
    engine._set_fault_hook(2, faults.ExitAtStep(engine.stats()["num_steps"] + 4))
    again = _ids(engine.generate([{"prompt_token_ids": p} for p in undisturbed_prompts],
                                 _seeded(budgets0)))
    assert engine.stats()["num_stage_restarts"] == restarts + 1
    assert again == seeded_ref
    engine.check()
    assert len(engine.stats()["stage_recovery_s"]) == restarts + 1


def test_past_max_stage_restarts_unfinished_fail_finished_return(ray_cluster, model):
    """max_stage_restarts=0: a lost stage fails the unfinished requests with a clear error;
    the requests that had finished are still returned (on the exception). Then the driver
    dies: the handle fails fast and clearly, and shutdown() does not raise."""
    llm = LLM(model, pipeline_parallel_size=2, max_num_batched_tokens=32, max_num_seqs=4,
              max_stage_restarts=0)
    try:
        prompts = [[7, 8, 9]] * 2 + [[5] * 40] * 4
        budgets = [1, 2, 30, 30, 30, 30]
        llm._set_fault_hook(1, faults.ExitAtStep(8))
        with pytest.raises(RequestFailed, match="max_stage_restarts=0") as err:
            llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(budgets))
        finished = err.value.finished
        assert {o.request_id.split("-")[0] for o in finished} >= {"0", "1"}
        for o in finished:
            i = int(o.request_id.split("-")[0])
            assert_matches(list(o.outputs[0].token_ids), hf_greedy(model, tuple(prompts[i]),
                                                                   budgets[i]), f"request {i}")
        with pytest.raises(RuntimeError, match="cannot run any more|broken"):
            llm.generate([{"prompt_token_ids": [5, 6]}], _greedy([2]))
        ray.kill(llm._driver)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="driver"):
            llm.generate([{"prompt_token_ids": [5, 6]}], _greedy([2]))
        assert time.monotonic() - t0 < 10
    finally:
        llm.shutdown()  # never raises, even with the driver dead
