"""Run a test's Ray program (a `python -m` module) in a process of its own, with a private
Ray session: its own RAY_TMPDIR, token auth with a fresh token, no inherited RAY_ADDRESS.
The process leads a session of its own, so on a timeout the whole group goes (the nodes'
processes with it), never anything else. Used by the tests whose cluster cannot share this
pytest session's ray.init (two nodes via ray.cluster_utils.Cluster)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import ROOT


def run_private_ray(module: str, args: dict, timeout_s: float = 240) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of `python -m module json(args)`; fails the test on a
    timeout, with the tail of its output."""
    with tempfile.TemporaryDirectory(prefix="rp", dir="/tmp") as tmp:
        token = os.path.join(tmp, "auth_token")
        with open(token, "w") as f:
            f.write(os.urandom(32).hex())
        # Ray's files (and the address file `ray.init(address="auto")` reads) stay in tmp.
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "RAY_TMPDIR": tmp,
               "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(args)], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{module} timed out after {timeout_s} s:\n{(out + err)[-4000:]}")
    return proc.returncode, out, err
