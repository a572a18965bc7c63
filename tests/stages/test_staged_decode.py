"""Decode steps staged straight into their graph's buffer (stages/graph_inputs.py,
stages/cuda_graphs.py): on CUDA the graph is captured; here on CPU the same step function
runs eagerly at each "replay" (capture=False), so the packing, the padding rows, the block
tables gathered from the device mirror and the fed ids patched in from the device buffer of
samples are all exercised. The real EngineCore over one StageRunner (LocalRanks, PP=1,
overlapped: pending samples are patched in), against HF greedy."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from ray_runtime.config import EngineConfig
from ray_runtime.engine_core import EngineCore
from ray_runtime.layer_span import LayerSpan
from ray_runtime.messages import RequestSpec
from ray_runtime.ranks import LocalRanks
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams
from stages.graph_inputs import GraphInputs
from stages.model_spec import ModelSpec
from stages.runner import StageRunner
from tests.conftest import stress_workload
from tests.reference import assert_matches, hf_greedy

NUM_BLOCKS = 200


def _run(model_dir: str, prompts, params, staged: bool, max_num_seqs: int = 8,
         graph_rows=None, block_size: int = 16, monkeypatch=None):
    """graph_rows: the graphs' largest size, as a lane's share at PP>1 (EngineConfig.
    max_lane_size), instead of max_num_seqs."""
    spec = ModelSpec.from_dir(model_dir)
    cfg = EngineConfig(model=model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=48,
                       num_kv_blocks=NUM_BLOCKS, max_model_len=320, disable_log_stats=True,
                       block_size=block_size)
    runner = StageRunner(cfg, 0, LayerSpan.of_layers(0, spec.num_layers), 320)
    runner.init_kv_cache(NUM_BLOCKS + 1)  # the last block: the padding rows' scratch
    dirty_over = [0]  # staged steps with more changed block-table rows than graph rows
    if staged:
        if graph_rows is not None:
            monkeypatch.setattr(EngineConfig, "max_lane_size", property(lambda self: graph_rows))
        runner.use_decode_graphs(scratch_block=NUM_BLOCKS, capture=False)
        stage = runner.graphs.stage

        def watching(rows, *a, **kw):
            dirty_over[0] += int(np.count_nonzero(runner.batch.table_dirty)) > runner.graphs.max_rows
            return stage(rows, *a, **kw)

        runner.graphs.stage = watching
    core = EngineCore(cfg, LocalRanks(runner, overlap=True), num_kv_blocks=NUM_BLOCKS,
                      max_model_len=320, eos_token_ids=spec.eos_token_ids)
    replays, sizes = [0], set()
    if staged:
        run = runner.graphs.run

        def counting(st, x, head=False):
            replays[0] += 1
            sizes.add((st.n, st.b, head))
            return run(st, x, head=head)

        runner.graphs.run = counting
    for i, (p, sp) in enumerate(zip(prompts, params)):
        sp = msgspec.structs.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
        core.add_request(RequestSpec(f"r{i}", p, sp))
    outputs = {}
    for _ in range(5000):
        if not core.has_work():
            break
        for d in core.step():
            outputs[d.req_id] = d.new_token_ids
        runner.check()
    else:
        pytest.fail("did not finish")
    if graph_rows is not None:
        assert dirty_over[0], "no staged step had more changed table rows than graph rows"
    return outputs, replays[0], sizes


@pytest.mark.parametrize("sampled", [False, True])
def test_staged_decode_equals_eager(tiny_model, sampled):
    model = tiny_model("llama")
    prompts, budgets = stress_workload(seed=52, num_requests=11, max_len=90, max_tokens=(8, 30))
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                             seed=i if sampled else None) for i, m in enumerate(budgets)]
    eager, none, _ = _run(model, prompts, params, staged=False)
    staged, replays, sizes = _run(model, prompts, params, staged=True)
    assert none == 0
    assert replays > 20, f"only {replays} staged decode steps"
    assert any(b > n for n, b, _ in sizes), f"no padded replay among {sorted(sizes)}"
    # greedy steps sample in the graph's head, the others after it
    assert {head for *_, head in sizes} == {not sampled}
    assert staged == eager
    if not sampled:
        for i, (p, m) in enumerate(zip(prompts, budgets)):
            assert_matches(staged[f"r{i}"], hf_greedy(model, tuple(p), m), f"request {i}")


def test_graphs_sized_by_a_lane_take_the_whole_batch_s_table_changes(tiny_model, monkeypatch):
    """At PP>1 the graphs are captured up to a lane's share of max_num_seqs, but the block
    table rows that changed since the last step are the whole batch's (removals of another
    lane's finished requests, appended blocks): a 4-row step may carry 8 of them."""
    model = tiny_model("llama")
    prompts = [[5 + i, 6, 7] for i in range(8)]
    params = [SamplingParams(max_tokens=6 if i >= 4 else 40, ignore_eos=True, temperature=0.0)
              for i in range(8)]
    eager, _, _ = _run(model, prompts, params, staged=False, block_size=4)
    staged, replays, _ = _run(model, prompts, params, staged=True, graph_rows=4, block_size=4,
                              monkeypatch=monkeypatch)
    assert replays > 20 and staged == eager


def test_graph_inputs_pack_pads_and_copies_only_what_is_used():
    gi = GraphInputs(8, 3, table_rows=8, scratch_slot=160, pad_row=5, device="cpu", depth=2)
    gi.device_buffer.fill_(-7)
    st = gi.stage(4, positions=np.array([3, 9]), slots=np.array([19, 41]), rows=np.array([2, 0]),
                  ids=np.array([11, 0]), fed=np.array([0, 1]), sample_slots=np.array([2, 0]),
                  dirty_slots=np.array([0]), dirty_rows=np.array([[4, 5, 6]]))
    v = gi.views
    assert (st.n, st.b) == (2, 4)
    assert v["positions"][:4].tolist() == [3, 9, 0, 0]
    assert v["slots"][:4].tolist() == [19, 41, 160, 160]
    assert v["ctx"][:4].tolist() == [4, 10, 1, 1]
    assert v["rows"][:4].tolist() == [2, 0, 5, 5]
    assert v["ids"][:4].tolist() == [11, 0, 0, 0] and v["fed"][:4].tolist() == [0, 1, 0, 0]
    assert st.sample_slots.tolist() == [2, 0]
    assert st.num_dirty == 1 and st.dirty_slots.tolist() == [0]
    assert st.dirty_rows.tolist() == [[4, 5, 6]]
    # without dirty rows the copy stops after the sampled slots' segment
    st = gi.stage(2, positions=np.array([1]), slots=np.array([1]), rows=np.array([3]),
                  ids=np.array([4]), fed=np.array([0]),
                  sample_slots=np.array([3]), dirty_slots=np.array([], np.int64),
                  dirty_rows=np.zeros((0, 3), np.int64))
    assert st.num_dirty == 0 and st.dirty_rows.shape == (0, 3)
    rows_at = 6 * 8 + 2 * 8  # six segments, the sampled and the dirty slots, then the rows
    assert gi.device_buffer[rows_at:rows_at + 3].tolist() == [4, 5, 6], "the first step's"
    assert gi.device_buffer[rows_at + 3:].tolist() == [-7] * (3 * 8 - 3), "never copied"
    with pytest.raises(ValueError, match="depth"):
        GraphInputs(8, 3, table_rows=8, scratch_slot=0, pad_row=0, device="cpu", depth=1)
    with pytest.raises(ValueError, match="0 < rows <= size <= 8"):
        gi.stage(9, positions=np.arange(9), slots=np.arange(9), rows=np.arange(9),
                 ids=np.zeros(9, np.int64), fed=np.zeros(9, np.int64),
                 sample_slots=np.arange(9), dirty_slots=np.array([], np.int64),
                 dirty_rows=np.zeros((0, 3), np.int64))


def test_graph_inputs_take_every_changed_table_row_of_the_batch():
    """A 2-row graph buffer of a 6-slot batch takes 6 changed block-table rows (a lane's
    step carries the whole batch's changes), and refuses more than the batch has."""
    gi = GraphInputs(2, 3, table_rows=6, scratch_slot=0, pad_row=6, device="cpu", depth=2)
    one = dict(positions=np.array([1]), slots=np.array([1]), rows=np.array([0]),
               ids=np.array([4]), fed=np.array([0]), sample_slots=np.array([0]))
    rows = np.arange(18).reshape(6, 3)
    st = gi.stage(1, dirty_slots=np.arange(6), dirty_rows=rows, **one)
    assert st.num_dirty == 6 and st.dirty_slots.tolist() == list(range(6))
    assert st.dirty_rows.tolist() == rows.tolist()
    with pytest.raises(ValueError, match="7 changed block-table rows; the batch has 6"):
        gi.stage(1, dirty_slots=np.arange(7), dirty_rows=np.zeros((7, 3), np.int64), **one)


def test_mirror_has_a_pad_row_of_scratch_blocks(tiny_model):
    model = tiny_model("llama")
    spec = ModelSpec.from_dir(model)
    cfg = EngineConfig(model=model, max_num_seqs=4, max_num_batched_tokens=32,
                       num_kv_blocks=20, max_model_len=64, disable_log_stats=True)
    runner = StageRunner(cfg, 0, LayerSpan.of_layers(0, spec.num_layers), 64)
    runner.init_kv_cache(21)
    runner.use_decode_graphs(scratch_block=20, capture=False)
    table = runner.device_table.table
    assert table.shape[0] == cfg.max_num_seqs + 1
    assert torch.equal(table[-1], torch.full_like(table[-1], 20))
    assert runner.graphs.inputs.pad_row == cfg.max_num_seqs
    assert runner.fed_tokens.shape[0] == cfg.max_num_seqs + 1


def test_mixed_greedy_and_sampled_steps(tiny_model):
    """Greedy requests beside sampled ones: steps whose rows are all greedy sample in the
    graph's head, the others after the graph; outputs equal the eager path's."""
    model = tiny_model("llama")
    prompts, budgets = stress_workload(seed=54, num_requests=9, max_len=60, max_tokens=(12, 30))
    # the sampled requests finish first: the greedy ones then run all-greedy steps
    params = [SamplingParams(max_tokens=m if i % 3 else 4, ignore_eos=True,
                             temperature=0.0 if i % 3 else 0.9, seed=i)
              for i, m in enumerate(budgets)]
    eager, _, _ = _run(model, prompts, params, staged=False)
    staged, _, sizes = _run(model, prompts, params, staged=True)
    assert {head for *_, head in sizes} == {False, True}
    assert staged == eager
