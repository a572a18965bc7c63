"""Placement that can never succeed is found before any placement group waits
(ray_runtime/cluster.py, placement_shortfall): the numbers, and the flag that would fit."""
import pytest

from ray_runtime.cluster import placement_shortfall

ONE_NODE = {"a" * 56: {"CPU": 2.0, "memory": 1e9}}
TWO_NODES = {"a" * 56: {"CPU": 2.0}, "b" * 56: {"CPU": 2.0}}
GPU_NODES = {"g1" * 28: {"CPU": 8.0, "GPU": 1.0}, "g2" * 28: {"CPU": 8.0, "GPU": 1.0}}


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
def test_fits_when_the_cluster_can_hold_the_stages(strategy):
    assert placement_shortfall(2, {"CPU": 1.0}, strategy, TWO_NODES) is None
    assert placement_shortfall(2, {"CPU": 1.0, "GPU": 1}, "SPREAD", GPU_NODES) is None


def test_too_few_cpus_in_total_names_the_numbers_and_flags_never_spread():
    why = placement_shortfall(3, {"CPU": 1.0}, "PACK", ONE_NODE)
    assert "pipeline_parallel_size=3" in why and "3 CPU in all" in why
    assert "2 CPU in total on 1 node" in why
    assert "--pipeline-parallel-size" in why and "--num-cpus-per-stage" in why
    assert "SPREAD" not in why, "spreading cannot help when the total is short"


def test_too_few_gpus_does_not_advise_fewer_cpus():
    why = placement_shortfall(3, {"CPU": 1.0, "GPU": 1}, "PACK", GPU_NODES)
    assert "2 GPU in total" in why and "3 GPU in all" in why
    assert "--num-cpus-per-stage" not in why and "SPREAD" not in why


def test_a_bundle_must_fit_on_one_node():
    nodes = {"a" * 56: {"CPU": 1.5}, "b" * 56: {"CPU": 1.5}}  # 3 CPU in all, 2 bundles fit
    why = placement_shortfall(3, {"CPU": 1.0}, "PACK", nodes)
    assert "must fit on one node" in why and "hold only 2" in why


def test_strict_spread_needs_a_node_per_stage_and_says_spread_would_fit():
    why = placement_shortfall(2, {"CPU": 1.0}, "STRICT_SPREAD", ONE_NODE)
    assert "STRICT_SPREAD" in why and "only 1 of the cluster's 1 node(s)" in why
    assert "--placement-strategy SPREAD" in why


def test_strict_pack_needs_one_node_for_all():
    why = placement_shortfall(3, {"CPU": 1.0}, "STRICT_PACK", TWO_NODES)
    assert "STRICT_PACK" in why and "largest node holds only 2" in why
    assert "--placement-strategy PACK" in why


def test_no_nodes():
    assert "0 node(s)" in placement_shortfall(1, {"CPU": 1.0}, "PACK", {})
