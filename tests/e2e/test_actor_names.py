"""Named, readable actors (issue 11, item 3): the driver and each stage are named by engine,
role, rank and layer range, and their repr (the dashboard's Actors page, the log prefix)
says the same."""
import ray
from ray.core.generated import gcs_pb2

from ray_runtime import LLM


def _repr_name(handle) -> str:
    """The repr Ray recorded for an actor (the dashboard's and `ray list actors --detail`'s
    repr_name), read from the GCS actor table: the state API needs the dashboard."""
    from ray._private.state import state

    info = state._connect_and_get_accessor().get_actor_info(handle._actor_id)
    return gcs_pb2.ActorTableData.FromString(info).repr_name


def test_driver_and_stages_are_named_and_readable(ray_cluster, tiny_model):
    with LLM(tiny_model("llama"), pipeline_parallel_size=2, num_kv_blocks=16,
             max_model_len=128) as llm:  # 5 layers: 0-2 and 3-4
        eid = llm.info["engine_id"]
        driver = ray.get_actor(f"ray_pp-{eid}-driver")
        assert ray.get(driver.info.remote())["engine_id"] == eid
        assert _repr_name(driver).startswith(f"Driver(engine={eid}, pp=2, model=")
        for rank, (first, last) in enumerate([(0, 2), (3, 4)]):
            stage = ray.get_actor(f"ray_pp-{eid}-stage{rank}of2-layers{first}-{last}")
            info = ray.get(stage.node_info.remote())
            assert info["rank"] == rank and info["layers"] == [first, last + 1]
            # the prefill split moves layer 2's MLP (ray_runtime/layer_span.py)
            prefill = ["0-2a", "2m-4"][rank]
            assert info["prefill_layers"] == [[0, 2.5], [2.5, 5]][rank]
            assert _repr_name(stage) == \
                f"StageWorker(rank={rank}/2, layers={first}-{last} (prefill {prefill}), engine={eid})"


def test_stats_say_where_each_stage_runs(ray_cluster, tiny_model):
    with LLM(tiny_model("llama"), pipeline_parallel_size=2, num_kv_blocks=16,
             max_model_len=128) as llm:
        placement = llm.stats()["stage_placement"]
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert [p["rank"] for p in placement] == [0, 1]
    assert [p["layers"] for p in placement] == [[0, 3], [3, 5]]
    for p in placement:
        assert nodes.get(p["node_id"]) == p["node_ip"], p
        assert p["gpu_ids"] == [] and p["pid"] > 0  # a CPU engine


def test_a_dead_driver_fails_fast_and_shutdown_does_not_raise(ray_cluster, tiny_model):
    import pytest

    from ray_runtime import SamplingParams

    llm = LLM(tiny_model("llama"), pipeline_parallel_size=2, num_kv_blocks=16, max_model_len=128)
    ray.kill(ray.get_actor(f"ray_pp-{llm.info['engine_id']}-driver"))
    with pytest.raises(RuntimeError, match="driver actor died") as err:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    assert isinstance(err.value.__cause__, ray.exceptions.RayActorError)
    llm.shutdown()  # must not raise
    assert llm.final_stats is None
