"""`ray job submit` end to end (issue 11, item 7), as a user runs it: a `ray start` head with
the dashboard and token authentication on (tests/e2e/ray_head.py), the CLI submitted with
Ray's job SDK and with the `ray job submit` command, the token passed as the README says."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.e2e.ray_head import _ray_cli, ray_head
from tests.reference import assert_matches, hf_greedy

RUNTIME_ENV = {"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}}


@pytest.fixture(scope="module")
def head():
    with ray_head(num_cpus=4) as h:
        yield h


def _wait(client, job_id: str, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while not (status := client.get_job_status(job_id)).is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            pytest.fail(f"job {job_id} still {status} after {timeout_s:.0f}s:\n"
                        f"{client.get_job_logs(job_id)[-3000:]}")
        time.sleep(0.5)
    return status


def test_the_dashboard_refuses_a_client_without_the_token(head):
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    with pytest.raises(AuthenticationError):
        JobSubmissionClient(head.dashboard_url, headers={"Authorization": "Bearer wrong"})


def test_generate_job_succeeds_with_outputs_and_logs(head, tiny_model, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    model = tiny_model("llama")
    prompts = [[5, 6, 7 + i, 11, 12] for i in range(4)]
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    client = JobSubmissionClient(head.dashboard_url, headers=head.auth_headers())
    job = client.submit_job(
        entrypoint=f"python -m ray_runtime generate --model {model} --pipeline-parallel-size 2 "
                   f"--input {src} --output {dst} --max-tokens 5 --ignore-eos",
        runtime_env=RUNTIME_ENV)
    status = _wait(client, job)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    for r, p in zip(rows, prompts):
        assert_matches(r["token_ids"], hf_greedy(model, tuple(p), 5), f"job row {r['index']}")
    # The entrypoint joined the job's cluster (RAY_ADDRESS), not a private one.
    assert f"joined the Ray cluster at" in logs and "(RAY_ADDRESS=" in logs, logs[-3000:]
    assert "4 requests, 20 output tokens" in logs  # the CLI's summary line
    assert "progress: 4/4 requests done, 20 output tokens" in logs, logs[-3000:]  # off a terminal
    for rank in (0, 1):  # each stage's start line names its rank, once
        assert logs.count(f"stage rank {rank}/2: layers") == 1, logs[-3000:]


def test_bad_input_job_fails_with_the_message_in_its_logs(head, tiny_model, tmp_path):
    """Submitted with the `ray job submit` command, the token found as a user's shell would
    (RAY_AUTH_MODE=token, the token file in RAY_AUTH_TOKEN_PATH)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6], "sampling_params": {"top_p": 3}}) + "\n")
    job = f"bad-input-{os.getpid()}-{int(time.time())}"
    env = {**os.environ, **head.env}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        _ray_cli() + ["job", "submit", "--address", head.dashboard_url, "--submission-id", job,
                      "--runtime-env-json", json.dumps(RUNTIME_ENV), "--",
                      sys.executable, "-m", "ray_runtime", "generate", "--model",
                      tiny_model("llama"), "-pp", "2", "--input", str(src), "--output",
                      str(tmp_path / "o.jsonl")],
        env=env, capture_output=True, text=True, timeout=180)
    client = JobSubmissionClient(head.dashboard_url, headers=head.auth_headers())
    status = _wait(client, job)
    logs = client.get_job_logs(job)
    assert status == JobStatus.FAILED, (proc.stdout + proc.stderr)[-3000:]
    assert "bad.jsonl:1" in logs and "top_p" in logs, logs[-3000:]
    assert "bad.jsonl:1" in proc.stdout + proc.stderr, "ray job submit shows the job's logs"
    assert not (tmp_path / "o.jsonl").exists()
