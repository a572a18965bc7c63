"""Every node that hosts a stage loads its layers from the model path: a node without the
folder is an error naming the node and the path (stages/worker.py, require_model_folder),
raised in the stage actor before any weight is read, and passed on by start_stages."""
import pytest
import ray

from ray_runtime.cluster import start_stages
from ray_runtime.layer_span import LayerSpan, StageBlocks
from ray_runtime.config import EngineConfig
from stages.worker import require_model_folder


def test_the_check_names_the_rank_and_the_path(tmp_path):
    missing = str(tmp_path / "not-here")
    with pytest.raises(FileNotFoundError, match=r"stage rank 1: the model folder .*not-here.* "
                                                r"is missing on node .*: no such folder"):
        require_model_folder(missing, 1)
    with pytest.raises(FileNotFoundError, match="no config.json in it"):
        require_model_folder(str(tmp_path), 0)


def test_a_stage_on_a_node_without_the_model_fails_naming_node_and_path(ray_cluster, tmp_path):
    """One machine has one filesystem: a path that no node has stands in for a node without
    the checkpoint."""
    from ray.util.placement_group import placement_group, remove_placement_group

    missing = str(tmp_path / "only-on-another-node")
    config = EngineConfig(model=missing, pipeline_parallel_size=1)
    pg = placement_group([{"CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    try:
        with pytest.raises(RuntimeError) as e:
            both = LayerSpan.of_layers(0, 2)
            start_stages(config, pg, [StageBlocks(both, both)], max_model_len=64,
                         engine_id="nomodel")
    finally:
        remove_placement_group(pg)
    msg = str(e.value)
    node = ray.get_runtime_context().get_node_id()
    assert f"the model folder {missing!r} is missing on node {node}" in msg, msg
    assert msg.startswith("stage rank 0 did not start"), msg
