"""Which Ray cluster the engine joins (ray_runtime/cluster.py, connect_ray): only the one
named (address= / --address, RAY_ADDRESS), else a private local one sized for a later engine
of a larger PP size; never a cluster it merely finds on the machine."""
import json
import os
import subprocess
import sys

import pytest

from ray_runtime.cluster import LOCAL_CLUSTER_MIN_CPUS, connect_ray
from ray_runtime.config import EngineConfig
from tests.conftest import ROOT
from tests.e2e.ray_head import ray_head


def _connect(head, address=None, ray_address=None, place=False) -> dict:
    env = {**os.environ, **head.env, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    proc = subprocess.run([sys.executable, "-m", "tests.ray_runtime.connect_run",
                           json.dumps({"address": address, "place": place})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return {**json.loads(line[len("REPORT "):]), "log": proc.stderr}


@pytest.fixture(scope="module")
def head():
    """A `ray start` head whose address file is where `ray.init(address="auto")` looks
    (RAY_TMPDIR), the trap the engine must not fall into."""
    with ray_head(num_cpus=2) as h:
        yield h


def test_without_an_address_it_starts_a_private_cluster_sized_for_more_stages(head):
    r = _connect(head, place=True)
    assert r["gcs_address"] != head.gcs_address, "joined a cluster it only found"
    assert "started a private local Ray cluster" in r["joined"] and r["joined"] in r["log"]
    assert r["cpus"] >= max(os.cpu_count() or 1, LOCAL_CLUSTER_MIN_CPUS)
    assert r["placed"] == 2, "a PP=3 engine beside a PP=2 one must place"


@pytest.mark.parametrize("how", ["address", "RAY_ADDRESS"])
def test_it_joins_the_cluster_named(head, how):
    r = _connect(head, **{"address" if how == "address" else "ray_address": head.gcs_address})
    assert r["gcs_address"].split(":")[1] == head.gcs_address.split(":")[1]
    assert f"joined the Ray cluster at" in r["joined"] and f"({how}=" in r["joined"]
    assert r["cpus"] == 2


def test_a_process_that_joined_a_cluster_keeps_it(ray_cluster):
    import ray

    joined = connect_ray(EngineConfig(model="unused", pipeline_parallel_size=2))
    assert joined.startswith("using the Ray cluster this process already joined")
    assert ray.get_runtime_context().gcs_address in joined
