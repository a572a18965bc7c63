"""cluster_configs/ would run: every YAML parses; the KubeRay manifests carry what KubeRay's
ray.io/v1 CRDs require (tests/cluster_configs/manifests.py); the cluster-launcher YAML
passes Ray's own config preparation and validation (its schema, ray/autoscaler/
ray-schema.json, through jsonschema: what `ray up` runs); the runtime env is one Ray
accepts."""
import json
import os
import re

import jsonschema
import pytest
import yaml

from tests.cluster_configs import manifests as m


@pytest.mark.parametrize("name", m.yaml_files())
def test_yaml_parses(name):
    with open(m.path(name)) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs), name


def test_the_configs_are_all_there():
    assert {m.RAYCLUSTER, m.RAYJOB, m.LAUNCHER, m.RUNTIME_ENV, "prometheus.yml"} <= set(m.yaml_files())


@pytest.mark.parametrize("name,kind", [(m.RAYCLUSTER, "RayCluster"), (m.RAYJOB, "RayJob")])
def test_kuberay_manifest_fields(name, kind):
    doc = m.load(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    assert len(doc["metadata"]["name"]) <= 63
    where = f"{name}:{kind}"
    if kind == "RayJob":
        spec = doc["spec"]
        assert not set(spec) - m.RAYJOB_SPEC_FIELDS, set(spec) - m.RAYJOB_SPEC_FIELDS
        assert isinstance(spec["entrypoint"], str) and spec["entrypoint"].strip()
        assert isinstance(spec.get("shutdownAfterJobFinishes", False), bool)
        assert isinstance(spec.get("ttlSecondsAfterFinished", 0), int)
        assert "rayClusterSpec" in spec or "clusterSelector" in spec
    assert m.cluster_spec_problems(where, m.cluster_spec(doc)) == []


def test_field_checks_catch_mistakes():
    """The checks above are not vacuous: typical mistakes are reported."""
    spec = m.cluster_spec(m.load(m.RAYCLUSTER))
    spec["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0  # an int in map[string]string
    spec["workerGroupSpecs"][0]["minReplicas"] = 9  # above replicas
    spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].pop("image")
    spec["workerGroupSpec"] = []  # a typo kubectl's strict validation rejects
    bad = "\n".join(m.cluster_spec_problems("x", spec))
    for needle in ("rayStartParams.num-gpus", "minReplicas <= replicas", "container image",
                   "unknown RayClusterSpec field workerGroupSpec"):
        assert needle in bad, (needle, bad)


def test_rayjob_runtime_env_is_valid_and_installs_nothing():
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load(m.load(m.RAYJOB)["spec"]["runtimeEnvYAML"])
    RuntimeEnv(**env)  # raises on a field Ray does not know
    assert not {"pip", "uv", "conda", "py_executable"} & set(env), env


def test_runtime_env_yaml_is_valid_and_installs_nothing():
    from ray.runtime_env import RuntimeEnv

    env = m.load(m.RUNTIME_ENV)
    RuntimeEnv(**env)
    assert not {"pip", "uv", "conda"} & set(env), "the nodes carry the dependencies"
    assert env["working_dir"] == "."


def test_launcher_yaml_passes_rays_schema():
    import ray

    with open(os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")) as f:
        schema = json.load(f)
    config = m.load(m.LAUNCHER)
    jsonschema.validate(config, schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema does reject bad input
        jsonschema.validate({**config, "docker": {**config["docker"], "imgae": "x"}}, schema)


def test_launcher_yaml_passes_ray_up_validation():
    """What `ray up` does to the file before it starts anything: defaults merged, then
    validated (schema, head node type, min/max workers, docker)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(m.load(m.LAUNCHER))
    validate_config(config)
    assert config["head_node_type"] in config["available_node_types"]
    gpus = sum(t["resources"].get("GPU", 0) * t.get("min_workers", 0)
               for t in config["available_node_types"].values())
    assert gpus >= 2, "the minimal cluster holds a PP=2 job"


def test_prometheus_config_scrapes_rays_discovery_file():
    cfg = m.load("prometheus.yml")
    files = [f for job in cfg["scrape_configs"] for sd in job.get("file_sd_configs", [])
             for f in sd["files"]]
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    assert f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}" in files  # Ray's default temp dir
