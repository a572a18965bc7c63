"""EngineConfig: derived settings and their defaults."""
from ray_runtime.config import EngineConfig


def test_inflight_steps_default_and_override():
    def cfg(**kw):
        return EngineConfig(model="unused", **kw)

    assert cfg().inflight_steps == 2  # PP=1: the next plan runs on the pending sample
    # two steps per micro-batch: the running one, and the next on its fed-back samples
    assert cfg(pipeline_parallel_size=4).inflight_steps == 8
    assert cfg(pipeline_parallel_size=4).num_microbatches == 4
    assert cfg(pipeline_parallel_size=4).feeds_tokens_back
    off = cfg(pipeline_parallel_size=4, pp_token_feedback=False)
    assert off.inflight_steps == 4 and off.num_microbatches == 1 and not off.feeds_tokens_back
    assert not cfg(pipeline_parallel_size=4, async_scheduling=False).feeds_tokens_back
    assert cfg(pipeline_parallel_size=4, max_inflight_steps=6).inflight_steps == 6
    assert cfg(pipeline_parallel_size=4, async_scheduling=False).inflight_steps == 1
