"""The overlapped step: a rank launches step N+1 before it finishes step N, so N's samples
are still pending (their values only in the device buffer) while N+1 is applied, staged and
run on them. In process, no Ray: the real EngineCore over one StageRunner (LocalRanks) at PP=1
with placeholders, driven serially and overlapped; the outputs must be the same token for token, greedy and
seeded, and the pending path must really have been taken."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from ray_runtime.config import EngineConfig
from ray_runtime.engine_core import EngineCore
from ray_runtime.messages import CachedRequestData, NewRequestData, RequestSpec, StepPlan
from ray_runtime.ranks import LocalRanks
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams
from stages.input_batch import InputBatch
from stages.model_spec import ModelSpec
from ray_runtime.layer_span import LayerSpan
from stages.runner import StageRunner
from tests.conftest import stress_workload
from tests.reference import assert_matches, hf_greedy


def _engine(model_dir: str, overlap: bool, max_model_len: int = 320) -> EngineCore:
    """The real engine core over one in-process StageRunner (PP=1, async placeholders)."""
    spec = ModelSpec.from_dir(model_dir)
    cfg = EngineConfig(model=model_dir, max_num_seqs=8, max_num_batched_tokens=48,
                       num_kv_blocks=200, max_model_len=max_model_len, disable_log_stats=True)
    runner = StageRunner(cfg, 0, LayerSpan.of_layers(0, spec.num_layers), max_model_len)
    runner.init_kv_cache(cfg.num_kv_blocks)
    return EngineCore(cfg, LocalRanks(runner, overlap=overlap), num_kv_blocks=200,
                      max_model_len=max_model_len, eos_token_ids=spec.eos_token_ids)


def _run(model_dir: str, prompts, params, overlapped: bool) -> tuple[dict, int]:
    """Two steps in flight (the PP=1 async default). Serial: each step is finished before
    the next is launched. Overlapped: step N+1 is launched before step N is finished, as
    the StepLoop does when N+1's plan is waiting. Returns outputs and patched input ids."""
    core = _engine(model_dir, overlap=overlapped)
    runner = core.ranks.runner
    for i, (p, sp) in enumerate(zip(prompts, params)):
        sp = msgspec.structs.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
        core.add_request(RequestSpec(f"r{i}", p, sp))
    num_patched = 0
    orig_prepare = runner.prepare_inputs

    def counting_prepare(plan):
        nonlocal num_patched
        inputs = orig_prepare(plan)
        num_patched += len(inputs.patch_index)
        return inputs

    runner.prepare_inputs = counting_prepare
    outputs = {}
    for _ in range(5000):
        if not core.has_work():
            break
        for d in core.step():
            assert d.finished  # FINAL_ONLY: one delta per request, all of its tokens
            outputs[d.req_id] = d.new_token_ids
        runner.check()
    else:
        pytest.fail("did not finish")
    return outputs, num_patched


@pytest.mark.parametrize("sampled", [False, True])
def test_overlapped_equals_serial(tiny_model, sampled):
    model = tiny_model("llama")
    prompts, budgets = stress_workload(seed=41, num_requests=10, max_len=90)
    params = [SamplingParams(max_tokens=m, ignore_eos=True,
                             temperature=0.8 if sampled else 0.0, seed=i if sampled else None)
              for i, m in enumerate(budgets)]
    serial, serial_patched = _run(model, prompts, params, overlapped=False)
    overlapped, patched = _run(model, prompts, params, overlapped=True)
    assert serial_patched == 0, "the serial run should never compute on a pending sample"
    assert patched > 20, f"only {patched} input ids came from pending samples"
    assert overlapped == serial
    if not sampled:
        for i, (p, m) in enumerate(zip(prompts, budgets)):
            assert_matches(overlapped[f"r{i}"], hf_greedy(model, tuple(p), m), f"request {i}")


def _req(req_id: str, tokens: list[int], incarnation: int = 1) -> NewRequestData:
    return NewRequestData(req_id=req_id, incarnation=incarnation, token_ids=tokens,
                          num_prompt_tokens=len(tokens), num_computed_tokens=0,
                          block_ids=[1, 2], sampling=SamplingParams(temperature=0.0))


def test_late_sample_for_a_freed_slot_is_dropped():
    """A's sample is pending when the next plan removes A and admits B into the same slot:
    when A's value lands it must not touch B (invariant 3)."""
    b = InputBatch(2, 32, 16)
    slot = b.add(_req("A", [5, 6, 7]))
    b.mark_computed("A", 3)
    gens = b.expect_samples(np.array([slot]))
    b.check()
    b.apply_plan(StepPlan(1, ["A"], [_req("B", [9, 9], incarnation=2)], CachedRequestData(), ["B"],
                           [2]))
    assert b.req_id_to_slot["B"] == slot
    landed = b.land_samples(np.array([slot]), gens, np.array([4242]))
    assert not landed.any()
    assert b.token_ids[slot, :3].tolist() == [9, 9, -1] and b.num_tokens_known[slot] == 2
    assert b.last_sampled_token[slot] == 9
    b.check()


def test_a_landed_sample_extends_the_known_prefix():
    b = InputBatch(2, 32, 16)
    slot = b.add(_req("A", [5, 6, 7]))
    b.mark_computed("A", 3)
    gens = b.expect_samples(np.array([slot]))
    b.mark_computed("A", 1)  # the next step already ran the pending token
    b.check()  # computed 4 <= known 3 + 1 pending
    assert b.land_samples(np.array([slot]), gens, np.array([11])).all()
    assert b.token_ids[slot, :4].tolist() == [5, 6, 7, 11] and b.num_pending_samples[slot] == 0
    b.check()


def test_device_block_table_mirror_is_checked(tiny_model, monkeypatch):
    """The device mirror of the block tables takes only the rows changed since the last step;
    runner.check() compares it with the host table. A mirror that drops the changes (planted)
    is caught, and the step outputs would read stale blocks."""
    from stages.device_state import DeviceBlockTable

    def dropped(self, slots, rows):
        self.batch.table_dirty[self._dirty] = False  # forgets to scatter

    monkeypatch.setattr(DeviceBlockTable, "apply", dropped)
    prompts, budgets = stress_workload(seed=44, num_requests=4, max_len=60)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in budgets]
    with pytest.raises(AssertionError, match="device block table drifted"):
        _run(tiny_model("llama"), prompts, params, overlapped=True)
