"""A stage that raises at step k (PP=2 and PP=3; the first, a middle and the last rank): the
call fails at once with that stage's error, the driver resets the inter-stage link
(ray_runtime/link.py), and the next call on the same LLM returns the reference outputs.

Without the reset the next call is refused (a rank that failed before it received its
activations finds them in front of its next step: stages/transport.py's step tags) or, before
the tags, hung until gloo's timeout. One engine per PP size serves every case."""
from __future__ import annotations

import time

import pytest
import ray

from ray_runtime import LLM, SamplingParams
from ray_runtime.output_processor import RequestFailed
from ray_runtime.cluster import stage_actor_name
from ray_runtime.layer_span import stage_blocks
from stages.model_spec import ModelSpec
from tests.conftest import stress_workload
from tests.reference import assert_matches, hf_greedy
from tests.stages.test_transport import listening_addresses

STEP_TIMEOUT_S = 20.0  # a hang would fail the call within this, and the bounds below catch it
BOUND_S = 10.0  # a failing call, and the call after it, take well under this
MAX_TOKENS = 5
CASES = [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]


class RaiseOnce:
    """A fault hook (StageRunner.fault_hook): raises on the nth plan this rank applies after
    it is installed."""

    def __init__(self, nth: int) -> None:
        self.nth, self.seen = nth, 0

    def __call__(self, batch, plan) -> None:
        self.seen += 1
        if self.seen == self.nth:
            raise RuntimeError(f"injected fault at step {plan.step_id}")


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny_model):
    model = tiny_model("llama")
    llms = {pp: LLM(model, pipeline_parallel_size=pp, max_num_seqs=8, max_num_batched_tokens=32,
                    step_timeout_s=STEP_TIMEOUT_S, debug_checks=True) for pp in (2, 3)}
    yield model, llms
    for llm in llms.values():
        llm.shutdown()


def link_infos(llm: LLM, pp: int) -> list[dict]:
    """Each stage's link_info(): how many times it has joined the link, where rank 0's store
    listens."""
    spec = ModelSpec.from_dir(llm.config.model)
    ranges = stage_blocks(spec.num_layers, pp, None, None, spec.attention_share)
    names = [stage_actor_name(llm.info["engine_id"], r, pp, lr) for r, lr in enumerate(ranges)]
    return ray.get([ray.get_actor(n).link_info.remote() for n in names])


def link_generations(llm: LLM, pp: int) -> list[int]:
    return [info["generation"] for info in link_infos(llm, pp)]


@pytest.mark.parametrize("pp,rank", CASES)
def test_stage_error_then_reference_outputs(engines, pp, rank):
    model, llms = engines
    llm = llms[pp]
    prompts, _ = stress_workload(seed=pp * 10 + rank, num_requests=4, min_len=8, max_len=40)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    generations = link_generations(llm, pp)

    llm._set_fault_hook(rank, RaiseOnce(nth=3))
    t0 = time.monotonic()
    with pytest.raises(RequestFailed) as err:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    failed_s = time.monotonic() - t0
    llm._set_fault_hook(rank, None)
    msg = str(err.value)
    assert f"stage rank {rank} failed" in msg and "injected fault at step" in msg, msg
    assert failed_s < BOUND_S, f"the failing call took {failed_s:.1f}s"
    assert link_generations(llm, pp) == [g + 1 for g in generations], "the link was not reset"

    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    next_s = time.monotonic() - t0
    assert next_s < BOUND_S, f"the call after the failure took {next_s:.1f}s"
    for i, (out, p) in enumerate(zip(outs, prompts)):
        assert_matches(out.outputs[0].token_ids, hf_greedy(model, tuple(p), MAX_TOKENS),
                       f"request {i} after a fault on rank {rank} of {pp}")
    llm.check()
    assert llm.stats()["bookkeeping_mismatches"] == 0


def test_rendezvous_store_listens_on_the_node_address(engines):
    """Rank 0's store (the stages run on this machine) listens on the node's address that
    it handed to the other ranks, not on every interface."""
    _, llms = engines
    host, port = link_infos(llms[2], 2)[0]["rendezvous"]
    assert host == ray.util.get_node_ip_address()
    assert listening_addresses(port) == [host]
