import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tests.tiny_models import VOCAB, make_tiny_model  # noqa: E402

# In-process tensors here are tiny: one intra-op thread avoids spin contention with the
# stage actors on a 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session. Logical CPUs exceed the 2 real cores so
    that PP=4 (one bundle per stage) places; each stage runs torch on one thread."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_bookkeeping_mismatches(request, monkeypatch):
    """Every engine a test builds must end with bookkeeping_mismatches == 0, unless the test
    corrupts a rank on purpose (@pytest.mark.corrupts_ranks)."""
    from ray_runtime import api

    built = []
    original = api.LLM.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(api.LLM, "__init__", tracking_init)
    yield
    if request.node.get_closest_marker("corrupts_ranks"):
        return
    for llm in built:
        stats = llm.final_stats if llm._closed else llm.stats()
        if stats is not None:
            assert stats["bookkeeping_mismatches"] == 0, stats


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_model(tiny_root):
    return lambda arch: make_tiny_model(arch, tiny_root)


def stress_workload(seed: int, num_requests: int = 24, min_len: int = 20, max_len: int = 250,
                    max_tokens: tuple[int, int] = (1, 12)):
    """Prompts of uniform random length and staggered max_tokens, so that requests finish
    at different steps and rows move while others are still in chunked prefill."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_requests)]
    budgets = [rng.randint(*max_tokens) for _ in range(num_requests)]
    return prompts, budgets
