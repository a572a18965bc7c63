"""AsyncLLM hosted in an async Ray actor, as a Ray Serve replica hosts it. Ray cancels an actor
task recursively: every Ray call submitted in that task's context is cancelled with it. When an
HTTP client hangs up, Serve cancels its request's task; the engine must lose that request only,
not the output poll that every request shares (it once died with a TaskCancelledError when the
first request of a server was the one cancelled)."""
import asyncio

import pytest

from ray_runtime import SamplingParams
from tests.reference import assert_matches, hf_greedy
from tests.tiny_models import make_tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def tok_model(tiny_root):
    return make_tiny_model_with_tokenizer("llama", tiny_root)


def _host_class():
    import ray

    @ray.remote(num_cpus=0)
    class Host:
        def __init__(self, model: str) -> None:
            from ray_runtime.async_llm import AsyncLLM

            from tests.e2e.faults import SlowSteps

            self.engine = AsyncLLM(model, pipeline_parallel_size=2, max_model_len=512)
            # >= 10 ms a step: the first request is still running when it is cancelled
            self.engine._set_fault_hook(1, SlowSteps(0.01))
            self.started = asyncio.Event()

        async def run(self, prompt: list[int], max_tokens: int) -> list[int]:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            ids: list[int] = []
            async for out in self.engine.generate({"prompt_token_ids": prompt}, sp):
                ids = list(out.outputs[0].token_ids)
                if ids:
                    self.started.set()
            return ids

        async def wait_started(self) -> None:
            await self.started.wait()

        def stats(self) -> dict:
            return self.engine.stats()

        def shutdown(self) -> None:
            self.engine.shutdown()

    return Host


def test_a_cancelled_first_request_leaves_the_engine_serving(ray_cluster, tok_model):
    import ray

    host = _host_class().remote(tok_model)
    try:
        # The first request starts the engine's output poll, in its own task's context.
        first = host.run.remote([3, 4, 5, 6], 480)
        ray.get(host.wait_started.remote(), timeout=120)
        ray.cancel(first)
        with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
            ray.get(first, timeout=60)
        ids = ray.get(host.run.remote([7, 8, 9], 12), timeout=120)
        assert_matches(ids, hf_greedy(tok_model, (7, 8, 9), 12, eos=False), "after a cancel")
        stats = ray.get(host.stats.remote())
        assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        # the cancelled request was aborted, not run to its end
        assert stats["num_generated_tokens"] < 480 + 12
    finally:
        ray.get(host.shutdown.remote())
        ray.kill(host)
