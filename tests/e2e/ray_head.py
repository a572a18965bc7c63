"""A Ray head of the test's own, started with `ray start --head --block` as a user would,
token authentication on: every port chosen by the OS, every file (the address file that
`ray.init(address="auto")` reads included) under a temporary directory, and stopped by
killing the process group it was started in. Never `ray stop`: that kills every Ray on the
machine."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


def free_ports(n: int) -> list[int]:
    """n distinct ports the OS has free now (all held open until all are chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class RayHead:
    gcs_address: str
    dashboard_url: str
    token: str
    env: dict  # what a client process needs: RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH, RAY_TMPDIR
    temp_dir: str

    def auth_headers(self) -> dict:
        """For JobSubmissionClient(headers=...): the bearer token the dashboard checks."""
        return {"Authorization": f"Bearer {self.token}"}


def _ray_cli() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "ray")
    return [exe] if os.path.isfile(exe) else [shutil.which("ray") or "ray"]


def _wait_for_dashboard(url: str, headers: dict, proc: subprocess.Popen, log: str,
                        timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n{_tail(log)}")
        try:
            req = urllib.request.Request(f"{url}/api/version", headers=headers)
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the dashboard at {url} did not answer in {timeout_s:.0f}s:\n"
                               f"{_tail(log)}")
        time.sleep(0.5)


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""


@contextlib.contextmanager
def ray_head(num_cpus: int = 4, timeout_s: float = 90.0, extra_env: dict | None = None):
    tmp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths must stay short
    token = secrets.token_hex(32)
    token_path = os.path.join(tmp, "auth_token")
    with open(token_path, "w") as f:
        f.write(token)
    client_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path,
                  "RAY_TMPDIR": tmp}
    env = {**os.environ, **client_env, **(extra_env or {})}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN", None)
    port, dash, agent_http, agent_grpc, runtime_env, metrics, client = free_ports(7)
    cmd = _ray_cli() + [
        "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
        f"--ray-client-server-port={client}",
        f"--temp-dir={os.path.join(tmp, 'ray')}", "--disable-usage-stats"]
    log = os.path.join(tmp, "ray_start.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        head = RayHead(gcs_address=f"127.0.0.1:{port}", dashboard_url=f"http://127.0.0.1:{dash}",
                       token=token, env=client_env, temp_dir=tmp)
        _wait_for_dashboard(head.dashboard_url, head.auth_headers(), proc, log, timeout_s)
        yield head
    finally:
        _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` (it stops the processes it started), then SIGKILL to
    the whole process group it leads, for anything left."""
    pgid = proc.pid  # start_new_session: the group is ours alone
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
