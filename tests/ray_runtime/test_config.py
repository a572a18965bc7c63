"""EngineConfig: derived settings and their defaults."""
from ray_runtime.config import EngineConfig


def test_inflight_steps_default_and_override():
    def cfg(**kw):
        return EngineConfig(model="unused", **kw)

    assert cfg().inflight_steps == 2  # PP=1: the next plan runs on the pending sample
    assert cfg(pipeline_parallel_size=4).inflight_steps == 4  # one micro-batch per stage
    assert cfg(pipeline_parallel_size=4, max_inflight_steps=6).inflight_steps == 6
    assert cfg(pipeline_parallel_size=4, async_scheduling=False).inflight_steps == 1
