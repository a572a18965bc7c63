"""The cluster configs do not expose the cluster (issue 13, item 6): Ray's token auth is on
in every one of them, the token has a stated way to every node and client, and the
dashboard (with the job API, i.e. remote code execution) listens on 127.0.0.1 unless a
manifest needs more, and then only with token auth."""
import re

import pytest

from tests.cluster_configs import manifests as m

LOOPBACK = "127.0.0.1"
# Manifests whose dashboard must listen on the pod network, and why.
NEEDS_POD_NETWORK = {m.RAYJOB: "the KubeRay operator and its submitter reach the job API "
                               "through the head Service"}


@pytest.mark.parametrize("name", [m.RAYCLUSTER, m.RAYJOB])
def test_kuberay_token_auth_and_dashboard_host(name):
    spec = m.cluster_spec(m.load(name))
    auth = spec["authOptions"]
    assert auth.get("mode", "token") == "token"  # KubeRay's default mode is token
    assert auth.get("secretName"), "the token's Secret is named, so clients can read it"
    text = open(m.path(name)).read()
    assert f"kubectl create secret generic {auth['secretName']}" in text  # how it is made
    if "RAY_AUTH_TOKEN=" in text:  # how a client gets it
        assert f"get secret {auth['secretName']}" in text
    host = spec["headGroupSpec"]["rayStartParams"].get("dashboard-host")
    assert host is not None, "KubeRay's default is 0.0.0.0: say where the dashboard listens"
    if name in NEEDS_POD_NETWORK:
        assert host == "0.0.0.0" and auth.get("mode", "token") == "token"
    else:
        assert host == LOOPBACK


def test_raycluster_tells_clients_how_to_get_the_token():
    text = open(m.path(m.RAYCLUSTER)).read()
    assert "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=" in text


def test_launcher_token_auth_everywhere():
    cfg = m.load(m.LAUNCHER)
    opts = " ".join(cfg["docker"]["run_options"])
    assert "--env RAY_AUTH_MODE=token" in opts  # every process in every node's container
    token_mounts = {dst: src for dst, src in cfg["file_mounts"].items() if "auth_token" in dst}
    assert token_mounts == {"/home/ray/.ray/auth_token": "~/.ray/auth_token"}, token_mounts


def test_launcher_dashboard_on_loopback():
    cfg = m.load(m.LAUNCHER)
    head = " ".join(cfg["head_start_ray_commands"])
    assert re.search(r"ray start --head\b", head)
    assert f"--dashboard-host={LOOPBACK}" in head
    for cmd in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]:
        assert "0.0.0.0" not in cmd, cmd


def test_submit_examples_use_token_auth():
    text = open(m.path("submit_examples.sh")).read()
    assert 'export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"' in text


def test_no_config_binds_a_dashboard_to_all_interfaces_silently():
    """Any other 0.0.0.0 in a config is a dashboard exposed without the checks above."""
    for name in m.yaml_files():
        if name in NEEDS_POD_NETWORK:
            continue
        lines = [ln for ln in open(m.path(name)) if "0.0.0.0" in ln.split("#")[0]]
        assert not lines, (name, lines)
