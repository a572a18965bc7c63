"""Loading cluster_configs/ and the KubeRay v1 field rules the tests check them against.

The rules are KubeRay's ray.io/v1 Go types (ray-operator/apis/ray/v1: raycluster_types.go,
rayjob_types.go) as the CRD schemas generated from them enforce: fields without
`omitempty` are required, map[string]string values must be strings, and `kubectl apply`
(strict field validation) rejects fields the CRD does not know.
"""
from __future__ import annotations

import os

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "cluster_configs")
RAYCLUSTER = "kuberay-raycluster.yaml"
RAYJOB = "kuberay-rayjob.yaml"
LAUNCHER = "ray-cluster-launcher.yaml"
RUNTIME_ENV = "runtime_env.yaml"
DOCKERFILE = os.path.join(CONFIGS, "docker", "Dockerfile")

# RayClusterSpec / RayJobSpec fields of KubeRay v1 (v1.6).
RAYCLUSTER_SPEC_FIELDS = {
    "upgradeStrategy", "authOptions", "suspend", "managedBy", "autoscalerOptions",
    "headServiceAnnotations", "enableInTreeAutoscaling", "gcsFaultToleranceOptions",
    "headGroupSpec", "rayVersion", "workerGroupSpecs"}
HEAD_GROUP_FIELDS = {"template", "headService", "enableIngress", "rayStartParams", "serviceType"}
WORKER_GROUP_FIELDS = {"suspend", "groupName", "replicas", "minReplicas", "maxReplicas",
                       "idleTimeoutSeconds", "rayStartParams", "template", "scaleStrategy",
                       "numOfHosts"}
RAYJOB_SPEC_FIELDS = {
    "activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate",
    "metadata", "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy",
    "entrypoint", "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources",
    "entrypointNumCpus", "entrypointNumGpus", "ttlSecondsAfterFinished",
    "shutdownAfterJobFinishes", "suspend"}
AUTH_MODES = {"disabled", "token"}


def path(name: str) -> str:
    return os.path.join(CONFIGS, name)


def load(name: str):
    with open(path(name)) as f:
        return yaml.safe_load(f)


def yaml_files() -> list[str]:
    out = []
    for d, _, files in os.walk(CONFIGS):
        out += [os.path.relpath(os.path.join(d, f), CONFIGS) for f in files
                if f.endswith((".yaml", ".yml"))]
    return sorted(out)


def cluster_spec(doc: dict) -> dict:
    """The RayClusterSpec of a RayCluster or RayJob document."""
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def groups(spec: dict):
    """(name, group spec, is_head) for the head and every worker group."""
    yield "head", spec["headGroupSpec"], True
    for g in spec.get("workerGroupSpecs", []):
        yield g.get("groupName"), g, False


def pod_problems(where: str, template: dict) -> list[str]:
    """What a Kubernetes PodTemplateSpec of these manifests gets wrong."""
    bad = []
    spec = template.get("spec") or {}
    containers = spec.get("containers") or []
    if not containers:
        bad.append(f"{where}: template.spec.containers is empty")
    volumes = {v.get("name") for v in spec.get("volumes", [])}
    for c in containers:
        cw = f"{where}.{c.get('name')}"
        for key in ("name", "image"):
            if not isinstance(c.get(key), str) or not c.get(key):
                bad.append(f"{cw}: container {key} missing")
        for m in c.get("volumeMounts", []):
            if m.get("name") not in volumes:
                bad.append(f"{cw}: volumeMount {m.get('name')} names no volume")
        for p in c.get("ports", []):
            if not isinstance(p.get("containerPort"), int):
                bad.append(f"{cw}: containerPort {p.get('containerPort')!r} is not an int")
            if len(p.get("name", "")) > 15:
                bad.append(f"{cw}: port name {p['name']} longer than 15")
        res = c.get("resources", {})
        for k, v in res.get("limits", {}).items():  # extended resources: requests == limits
            if "/" in k and res.get("requests", {}).get(k, v) != v:
                bad.append(f"{cw}: {k} requests != limits")
        for e in c.get("env", []):
            if "value" in e and not isinstance(e["value"], str):
                bad.append(f"{cw}: env {e.get('name')} value is not a string")
    return bad


def cluster_spec_problems(where: str, spec: dict) -> list[str]:
    bad = [f"{where}: unknown RayClusterSpec field {k}" for k in set(spec) - RAYCLUSTER_SPEC_FIELDS]
    if "headGroupSpec" not in spec:
        return bad + [f"{where}: headGroupSpec missing"]
    auth = spec.get("authOptions")
    if auth is not None and auth.get("mode", "token") not in AUTH_MODES:
        bad.append(f"{where}: authOptions.mode {auth.get('mode')!r}")
    if not isinstance(spec.get("rayVersion", ""), str):
        bad.append(f"{where}: rayVersion is not a string")
    names = []
    for name, g, head in groups(spec):
        gw = f"{where}.{name}"
        allowed = HEAD_GROUP_FIELDS if head else WORKER_GROUP_FIELDS
        bad += [f"{gw}: unknown field {k}" for k in set(g) - allowed]
        required = ("template", "rayStartParams") if head else \
            ("groupName", "template", "rayStartParams", "minReplicas", "maxReplicas")
        bad += [f"{gw}: {k} missing" for k in required if k not in g]
        params = g.get("rayStartParams") or {}
        bad += [f"{gw}: rayStartParams.{k} is not a string" for k, v in params.items()
                if not isinstance(v, str)]
        if not head:
            names.append(name)
            lo, n, hi = g.get("minReplicas", 0), g.get("replicas", 0), g.get("maxReplicas", 0)
            if not all(isinstance(x, int) for x in (lo, n, hi)) or not lo <= n <= hi:
                bad.append(f"{gw}: replicas must be ints, minReplicas <= replicas <= maxReplicas")
        bad += pod_problems(gw, g.get("template", {}))
    if len(names) != len(set(names)):
        bad.append(f"{where}: duplicate groupName")
    return bad
