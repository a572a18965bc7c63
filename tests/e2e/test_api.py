"""The Python API on one shared engine: bad input, seeded sampling, logprobs, text I/O."""
import json
import math
import shutil

import numpy as np
import pytest

from ray_runtime import LLM, SamplingParams
from tests.conftest import stress_workload
from tests.tiny_models import VOCAB


@pytest.fixture(scope="module")
def llm(ray_cluster, tiny_model):
    with LLM(tiny_model("llama"), pipeline_parallel_size=2, max_num_batched_tokens=64,
             num_kv_blocks=64, max_model_len=256, debug_checks=True) as engine:
        yield engine


GOOD = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.mark.parametrize("prompt,params,field", [
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": [5, VOCAB]}, SamplingParams(), "vocabulary"),
    ({"prompt_token_ids": [-1, 5]}, SamplingParams(), "vocabulary"),
    ({"prompt_token_ids": [5] * 256}, SamplingParams(), "max_model_len"),
    ({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=100, ignore_eos=True), None),  # truncated at max_model_len
    ("text without a tokenizer", SamplingParams(), "tokenizer"),
    ({"tokens": [1]}, SamplingParams(), "prompt_token_ids"),
])
def test_bad_prompt_is_a_clear_value_error_and_engine_keeps_serving(llm, prompt, params, field):
    if field is None:  # a valid edge: generation stops at max_model_len with "length"
        out = llm.generate(prompt, params)[0].outputs[0]
        assert out.finish_reason == "length" and 200 + len(out.token_ids) == 256
        return
    before = llm.stats()["num_steps"]
    with pytest.raises(ValueError, match=field):
        llm.generate([GOOD, prompt], params)
    assert llm.stats()["num_steps"] == before, "nothing may run when a request is rejected"
    out = llm.generate(GOOD, SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(top_k=-3), "top_k"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_mutated_after_construction_are_rechecked(llm):
    sp = SamplingParams(max_tokens=4)
    sp.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(GOOD, sp)


def test_bad_generate_calls_raise_in_the_caller_and_the_engine_keeps_serving(llm):
    """Inputs that once passed the checks and broke the driver (a bool or a 2**64 where an int
    belongs, None for a list) raise in the caller before anything runs; a temperature below
    1e-5 is greedy (no NaN probabilities); the next good call gives the same tokens as before."""
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = llm.generate(GOOD, greedy)[0].outputs[0].token_ids

    def set_after(**fields):  # built valid, then changed: generate() must check it again
        sp = SamplingParams(max_tokens=6, ignore_eos=True)
        for name, value in fields.items():
            setattr(sp, name, value)
        return sp

    bad_calls = [
        (lambda: llm.generate(GOOD, set_after(seed=True)), "SamplingParams.seed"),
        (lambda: llm.generate(GOOD, SamplingParams(seed=True)), "SamplingParams.seed"),
        (lambda: llm.generate(GOOD, set_after(seed=2 ** 64)), "SamplingParams.seed"),
        (lambda: llm.generate(None, greedy), "prompts"),
        (lambda: llm.generate([GOOD, None], greedy), r"prompts\[1\]"),
        (lambda: llm.generate(GOOD, set_after(stop_token_ids=None)), "stop_token_ids"),
        (lambda: llm.generate(GOOD, SamplingParams(stop_token_ids=None)), "stop_token_ids"),
        (lambda: llm.generate(GOOD, set_after(stop_token_ids=[VOCAB])), "stop_token_ids"),
        (lambda: llm.generate(GOOD, set_after(max_tokens=True)), "max_tokens"),
        (lambda: llm.generate(GOOD, set_after(max_tokens=2 ** 64)), "max_tokens"),
        (lambda: llm.generate(GOOD, set_after(ignore_eos="yes")), "ignore_eos"),
        (lambda: llm.generate(GOOD, set_after(temperature=math.inf)), "temperature"),
        (lambda: llm.generate([GOOD, {"prompt_token_ids": [5, 2 ** 64]}], greedy), "prompt_token"),
        (lambda: llm.generate([GOOD, {"prompt_token_ids": [5, True]}], greedy), "prompt_token"),
        (lambda: llm.generate(GOOD, {"max_tokens": 3}), "sampling_params"),
    ]
    before = llm.stats()["num_steps"]
    for call, field in bad_calls:
        with pytest.raises((ValueError, TypeError), match=field):
            call()
    assert llm.stats()["num_steps"] == before, "nothing may run when a request is rejected"

    tiny = SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True)
    assert tiny.is_greedy
    outs = llm.generate([GOOD, {"prompt_token_ids": np.array([5, 6, 7, 8])}], [tiny, greedy])
    assert [o.outputs[0].token_ids for o in outs] == [reference, reference]
    assert llm.generate(GOOD, greedy)[0].outputs[0].token_ids == reference


def test_kv_pool_too_small_for_one_request(ray_cluster, tiny_model):
    with LLM(tiny_model("llama"), num_kv_blocks=4, block_size=16) as small:
        with pytest.raises(ValueError, match="num_kv_blocks"):
            small.generate({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=10))
        out = small.generate({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=10))
        assert len(out[0].outputs[0].token_ids) == 10


def test_config_errors_raise_before_anything_runs(tiny_model, tmp_path):
    model = tiny_model("qwen2")  # 7 layers
    with pytest.raises(ValueError, match="pp_layer_partition"):
        LLM(model, pipeline_parallel_size=2, pp_layer_partition="3,3")
    with pytest.raises(ValueError, match="pp_layer_partition"):
        LLM(model, pipeline_parallel_size=3, pp_layer_partition="3,4")
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(model, pipeline_parallel_size=8)
    with pytest.raises(ValueError, match="max_inflight_steps"):
        LLM(model, max_inflight_steps=0)
    bad = tmp_path / "gpt2ish"
    shutil.copytree(model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture.*GPT2LMHeadModel.*supported.*LlamaForCausalLM"):
        LLM(str(bad))
    with pytest.raises(ValueError, match="dtype"):
        LLM(model, dtype="int8")


def test_seeded_sampling_same_tokens_at_pp1_and_pp2(ray_cluster, tiny_model, llm):
    """A seed fixes the tokens whatever the PP size (and the run differs from another seed)."""
    prompts, _ = stress_workload(seed=3, num_requests=8, max_len=60)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, min_p=0.01,
                             seed=100 + i, ignore_eos=True) for i in range(len(prompts))]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    pp2 = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
    with LLM(tiny_model("llama"), pipeline_parallel_size=1, max_num_batched_tokens=64,
             num_kv_blocks=64, max_model_len=256) as pp1_llm:
        pp1 = [o.outputs[0].token_ids for o in pp1_llm.generate(reqs, params)]
    assert pp1 == pp2
    other = [SamplingParams(max_tokens=12, temperature=0.9, seed=999 + i, ignore_eos=True)
             for i in range(len(prompts))]
    assert [o.outputs[0].token_ids for o in llm.generate(reqs, other)] != pp2


def test_logprobs_of_greedy_tokens(llm):
    out = llm.generate({"prompt_token_ids": list(range(10, 40))},
                       SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for tok, table in zip(out.token_ids, out.logprobs):
        assert tok in table and table[tok].rank == 1  # greedy picks the most likely token
        assert len(table) == 3  # chosen + top-3, where the chosen is the top-1
        assert max(lp.logprob for lp in table.values()) == table[tok].logprob <= 0.0
        total += table[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_stop_token_ids(llm):
    greedy = llm.generate(GOOD, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    toks = greedy[0].outputs[0].token_ids
    stop_at = toks[3]
    first = toks.index(stop_at)
    out = llm.generate(GOOD, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                            stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == toks[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_results_in_input_order_with_one_params_per_prompt(llm):
    prompts = [{"prompt_token_ids": [7] * n} for n in (50, 3, 20)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 9, 4)]
    outs = llm.generate(prompts, params)
    assert [len(o.prompt_token_ids) for o in outs] == [50, 3, 20]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 9, 4]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:2])



def test_the_first_steps_requests_go_first_and_the_rest_in_order(llm, monkeypatch):
    """generate() adds the requests of the first steps, then the rest once those are in
    (api.first_chunk): the outputs equal those of one add, in input order, and a bad prompt
    anywhere still stops the whole call before anything runs."""
    import ray_runtime.api as api
    from ray_runtime.messages import RequestSpec

    specs = [RequestSpec(req_id=str(i), prompt_token_ids=[5] * n, sampling=SamplingParams())
             for i, n in enumerate((3, 4, 5, 6))]
    assert [api.first_chunk(specs, t) for t in (1, 3, 4, 7, 8, 18, 19, 100)] == \
        [1, 1, 2, 2, 3, 4, 4, 4]
    prompts = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i] * (1 + i % 3)} for i in range(7)]
    params = [SamplingParams(max_tokens=2 + i % 4, temperature=0, ignore_eos=True) for i in range(7)]
    whole = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(api, "first_chunk", lambda specs, tokens: 2)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == whole
    before = llm.stats()["num_steps"]
    with pytest.raises(ValueError, match=r"prompts\[6\]"):
        llm.generate(prompts[:6] + [{"prompt_token_ids": [VOCAB]}], params)
    assert llm.stats()["num_steps"] == before, "nothing may run when a request is rejected"


def test_one_params_object_for_many_prompts_is_checked_once_and_still_checked(llm):
    """A SamplingParams shared by every prompt of a call is checked at its first prompt (the
    error names that index); the copies sent are equal and the outputs as with one each."""
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(5)]
    shared = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    own = [o.outputs[0].token_ids for o in llm.generate(
        prompts, [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True) for _ in prompts])]
    assert shared == own and all(len(t) == 3 for t in shared)
    sp.max_tokens = 0  # changed after construction: the call checks it again
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(prompts, sp)
