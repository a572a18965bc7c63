"""Greedy outputs equal HF transformers' token for token, through the whole Ray pipeline,
under the load that hides the seeds' bugs: 24 concurrent requests, prompts of 20-250 tokens,
a 32-token budget (chunked prefill), staggered max_tokens (rows move while others are
mid-prefill), and a KV cap that forces preemption."""
import pytest
import ray

from ray_runtime import LLM, SamplingParams
from tests.conftest import stress_workload
from tests.reference import assert_matches, hf_greedy
from tests.tiny_models import ARCHS

# Async (the default) for every architecture and depth; sync for one architecture per depth.
CASES = [(arch, pp, True) for arch in ARCHS for pp in (1, 2, 3, 4)]
CASES += [(ARCHS[pp - 1], pp, False) for pp in (1, 2, 3, 4)]


def run_and_compare(model, pp, prompts, budgets, keep=False, **engine):
    """keep: the engine stays up, returned as stats["llm"] (the caller shuts it down)."""
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in budgets]
    llm = LLM(model, pipeline_parallel_size=pp, debug_checks=True, **engine)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.stats()
        llm.check()
    except BaseException:
        llm.shutdown()
        raise
    if keep:
        stats["llm"] = llm
    else:
        llm.shutdown()
    ties = 0
    for i, (out, prompt, m) in enumerate(zip(outs, prompts, budgets)):
        comp = out.outputs[0]
        assert comp.finish_reason == "length" and len(comp.token_ids) == m
        ties += assert_matches(comp.token_ids, hf_greedy(model, tuple(prompt), m),
                               f"request {i} (PP={pp}, {model})")
    return stats, ties


@pytest.mark.parametrize("arch,pp,async_scheduling", CASES)
def test_greedy_equals_hf_under_stress(ray_cluster, tiny_model, arch, pp, async_scheduling):
    model = tiny_model(arch)
    prompts, budgets = stress_workload(seed=ARCHS.index(arch))
    stats, ties = run_and_compare(model, pp, prompts, budgets, max_num_seqs=16,
                                  max_num_batched_tokens=32, num_kv_blocks=30,
                                  async_scheduling=async_scheduling)
    assert stats["num_preemptions"] > 0, "the KV cap was meant to force preemption"
    assert stats["num_generated_tokens"] >= sum(budgets)
    # Async plans decode steps on pending samples (at PP>1 the last rank feeds them straight
    # to rank 0: stages/token_feedback.py); sync never does.
    assert (stats["num_placeholder_tokens"] > 0) == async_scheduling, stats
    assert ties <= 1, f"{ties} tie-excused divergences: suspicious for float32"


def test_uneven_partition_and_budget_64(ray_cluster, tiny_model):
    model = tiny_model("qwen2")  # 7 layers
    prompts, budgets = stress_workload(seed=11, num_requests=24)
    stats, _ = run_and_compare(model, 3, prompts, budgets, pp_layer_partition="1,4,2",
                               max_num_seqs=24, max_num_batched_tokens=64, num_kv_blocks=40)
    assert stats["num_steps"] > len(prompts)  # chunked: more steps than requests


def test_half_layer_partition(ray_cluster, tiny_model):
    """Stage boundaries inside layers (ray_runtime/layer_span.py): rank 0 ends on layer 1's
    attention, rank 1 starts on its MLP and ends on layer 3's attention."""
    model = tiny_model("llama")  # 5 layers
    prompts, budgets = stress_workload(seed=12, num_requests=24)
    stats, _ = run_and_compare(model, 3, prompts, budgets, pp_layer_partition="1.5,2,1.5",
                               max_num_seqs=16, max_num_batched_tokens=32, num_kv_blocks=30)
    assert stats["num_preemptions"] > 0 and [p["layers"] for p in stats["stage_placement"]] == \
        [[0, 1.5], [1.5, 3.5], [3.5, 5]]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prefill_split_moves_mlp_blocks_and_keeps_outputs(ray_cluster, tiny_model, async_scheduling):
    """A prefill split that differs from decode's at both boundaries (ray_runtime/layer_span.py):
    decode 2,2,1, prefill 1.5,2,1.5 (layer 1's MLP runs on rank 1 and layer 3's on rank 2 in
    prefill-shaped steps). Outputs equal HF under chunked prefill and preemption, and every
    rank ran each step on the same split, with steps of both kinds."""
    from ray_runtime.cluster import stage_actor_name
    from ray_runtime.layer_span import StageBlocks, stage_spans

    model = tiny_model("llama")  # 5 layers
    prompts, budgets = stress_workload(seed=13, num_requests=24)
    stats, _ = run_and_compare(model, 3, prompts, budgets, pp_layer_partition="2,2,1",
                               pp_prefill_partition="1.5,2,1.5", max_num_seqs=16,
                               max_num_batched_tokens=32, num_kv_blocks=30,
                               async_scheduling=async_scheduling, keep=True)
    llm = stats.pop("llm")
    try:
        placement = stats["stage_placement"]
        assert [p["layers"] for p in placement] == [[0, 2], [2, 4], [4, 5]]
        assert [p["prefill_layers"] for p in placement] == [[0, 1.5], [1.5, 3.5], [3.5, 5]]
        blocks = [StageBlocks(d, p) for d, p in zip(stage_spans(5, 3, (2, 2, 1)),
                                                      stage_spans(5, 3, (1.5, 2, 1.5)))]
        names = [stage_actor_name(llm.info["engine_id"], r, 3, b) for r, b in enumerate(blocks)]
        counts = ray.get([ray.get_actor(n).steps_by_split.remote() for n in names])
    finally:
        llm.shutdown()
    assert counts[0] == counts[1] == counts[2], counts
    assert counts[0]["prefill"] > 0 and counts[0]["decode"] > 0, counts
    assert stats["num_preemptions"] > 0


def test_eos_stops_unless_ignored(ray_cluster, tiny_model):
    """Without ignore_eos a request ends at the EOS the reference produces, and its
    neighbours are unaffected."""
    model = tiny_model("qwen2")
    prompts, _ = stress_workload(seed=5, num_requests=40, max_len=60)
    with LLM(model, pipeline_parallel_size=2, max_num_batched_tokens=48) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=40, temperature=0.0))
    stopped = 0
    for i, (out, p) in enumerate(zip(outs, prompts)):
        ref = hf_greedy(model, tuple(p), 40, eos=True)
        assert_matches(out.outputs[0].token_ids, ref, f"request {i}")
        if out.outputs[0].finish_reason == "stop":
            stopped += 1
            assert out.outputs[0].token_ids[-1] == 2
    assert stopped > 0, "workload meant to contain EOS stops"


@pytest.mark.parametrize("pp,inflight,feedback", [(2, 3, True), (3, 2, False)])
def test_micro_batch_count_keeps_outputs(ray_cluster, tiny_model, pp, inflight, feedback):
    """Fewer or more steps in flight than the default (2 x PP with token feedback: a lane's
    next step rides on its fed-back samples; PP without it: each request waits for its token
    through the driver, so the steps in flight are the micro-batches); the outputs must not
    care."""
    model = tiny_model("llama")
    prompts, budgets = stress_workload(seed=20 + inflight, num_requests=20)
    stats, ties = run_and_compare(model, pp, prompts, budgets, max_num_seqs=16,
                                  max_num_batched_tokens=32, num_kv_blocks=30,
                                  max_inflight_steps=inflight, pp_token_feedback=feedback)
    assert stats["num_preemptions"] > 0
    assert (stats["num_placeholder_tokens"] > 0) == feedback, stats
    assert ties <= 1
