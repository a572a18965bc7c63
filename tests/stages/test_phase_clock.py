"""RAY_RUNTIME_PHASE_CLOCK (stages/profiling.py): a stage times its host phases with the wall
clock and every reply carries the totals; the driver's stats() has them per rank, and
bench/pp_scaling.py turns two snapshots into ms per step. In process, the real EngineCore
over one StageRunner (LocalRanks, PP=1)."""
from __future__ import annotations

import msgspec
import pytest

from bench.pp_scaling import phase_ms_per_step
from ray_runtime.config import EngineConfig
from ray_runtime.engine_core import EngineCore
from ray_runtime.layer_span import LayerSpan
from ray_runtime.messages import RequestSpec
from ray_runtime.ranks import LocalRanks
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams
from stages import profiling
from stages.model_spec import ModelSpec
from stages.runner import StageRunner


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setenv(profiling.CLOCK_ENV, "1")
    profiling.start_step_loop("cpu")
    yield
    profiling._clock = None


def _core(model_dir: str) -> EngineCore:
    spec = ModelSpec.from_dir(model_dir)
    cfg = EngineConfig(model=model_dir, max_num_seqs=4, max_num_batched_tokens=64,
                       num_kv_blocks=64, max_model_len=128, disable_log_stats=True)
    runner = StageRunner(cfg, 0, LayerSpan.of_layers(0, spec.num_layers), 128)
    runner.init_kv_cache(cfg.num_kv_blocks)
    return EngineCore(cfg, LocalRanks(runner, overlap=True), num_kv_blocks=64,
                      max_model_len=128, eos_token_ids=spec.eos_token_ids)


def _generate(core: EngineCore, n: int) -> None:
    sp = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(n):
        core.add_request(RequestSpec(f"r{core.scheduler.num_steps}_{i}", [5 + i, 7, 9], sp))
    while core.has_work():
        core.step()


def test_the_clock_counts_every_steps_phases(tiny_model, clock):
    core = _core(tiny_model("llama"))
    _generate(core, 3)
    before = core.stats()
    phases = before["stage_phase_s"][0]
    steps = before["stage_steps"][0]
    assert steps > 0
    for name in ("apply plan", "stage inputs", "plan view", "forward", "digests", "sample"):
        count, seconds = phases[name]
        assert count == steps and seconds > 0, (name, count, steps)
    # nested phases count inside their parents
    assert phases["plan view"][1] <= phases["stage inputs"][1]
    _generate(core, 2)
    after = core.stats()
    ms = phase_ms_per_step(after, before)
    assert set(ms[0]) >= {"apply plan", "forward", "sample"}
    new_steps = after["stage_steps"][0] - before["stage_steps"][0]
    want = 1e3 * (after["stage_phase_s"][0]["forward"][1] - phases["forward"][1]) / new_steps
    assert ms[0]["forward"] == pytest.approx(want, abs=1e-3)


def test_without_the_clock_nothing_is_carried(tiny_model, monkeypatch):
    monkeypatch.delenv(profiling.CLOCK_ENV, raising=False)
    profiling._clock = None
    core = _core(tiny_model("llama"))
    _generate(core, 2)
    st = core.stats()
    assert st["stage_phase_s"] == [None]
    assert phase_ms_per_step(st, st) is None
    assert profiling.phase("x") is profiling._NULL


def test_a_reply_with_the_clock_round_trips():
    from ray_runtime.messages import StageTiming

    t = StageTiming(0.0, 0.0, 0.0, 0.0, 0.0, phases={"forward": (3, 0.5)})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(t), type=StageTiming)
    assert back.phases == {"forward": (3, 0.5)}
