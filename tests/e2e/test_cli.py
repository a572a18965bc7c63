"""`python -m ray_runtime generate`, the `ray job submit` entrypoint, end to end: jsonl in,
jsonl out, joining the running cluster."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, stress_workload
from tests.reference import assert_matches, hf_greedy


def _env() -> dict:
    """The CLI joins the session's cluster by RAY_ADDRESS (with no address it would start a
    private one)."""
    import ray

    return {**os.environ, "PYTHONPATH": ROOT,
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def test_cli_generate_jsonl(ray_cluster, tiny_model, tmp_path):
    model = tiny_model("mistral")
    prompts, budgets = stress_workload(seed=21, num_requests=6, max_len=80)
    src = tmp_path / "prompts.jsonl"
    with open(src, "w") as f:
        for p, m in zip(prompts, budgets):
            f.write(json.dumps({"prompt_token_ids": p, "sampling_params": {"max_tokens": m}}) + "\n")
        f.write("\n")  # blank lines are skipped
    dst = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "ray_runtime", "generate", "--model", model,
           "--pipeline-parallel-size", "2", "--input", str(src), "--output", str(dst),
           "--max-tokens", "99", "--temperature", "0", "--ignore-eos",
           "--max-num-batched-tokens", "32",
           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    env = _env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tok/s" in proc.stdout
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(prompts)))
    for r, p, m in zip(rows, prompts, budgets):
        assert r["finish_reason"] == "length" and len(r["token_ids"]) == m
        assert r["num_prompt_tokens"] == len(p)
        assert_matches(r["token_ids"], hf_greedy(model, tuple(p), m), f"cli row {r['index']}")


def test_cli_rejects_bad_input_with_exit_2(ray_cluster, tiny_model, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6], "sampling_params": {"top_p": 3}}) + "\n")
    cmd = [sys.executable, "-m", "ray_runtime", "generate", "--model", tiny_model("mistral"),
           "-pp", "1", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "top_p" in proc.stderr
    assert "bad.jsonl:1" in proc.stderr, "the error names the file and line"
    assert "Connecting" not in proc.stderr and "stage 0" not in proc.stderr, \
        "the input file is checked before any engine starts"


def test_cli_rejects_bad_speculative_config_with_exit_2(tiny_model, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6]}) + "\n")
    for bad, field in [("{not json", "--speculative-config"),
                       ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens")]:
        cmd = [sys.executable, "-m", "ray_runtime", "generate", "--model", tiny_model("mistral"),
               "-pp", "1", "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
               "--speculative-config", bad]
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and field in proc.stderr, proc.stderr[-2000:]


def test_cli_rejects_bad_max_inflight_steps_with_exit_2(tiny_model, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6]}) + "\n")
    cmd = [sys.executable, "-m", "ray_runtime", "generate", "--model", tiny_model("mistral"),
           "-pp", "1", "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
           "--max-inflight-steps", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "max_inflight_steps" in proc.stderr, proc.stderr[-2000:]


def _long_job(tmp_path, model):
    src = tmp_path / "long.jsonl"
    with open(src, "w") as f:
        for i in range(48):
            f.write(json.dumps({"prompt_token_ids": list(range(3 + i, 40 + i))}) + "\n")
    return src


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cli_stops_on_a_signal_within_5s_and_writes_no_output(ray_cluster, tiny_model, tmp_path,
                                                                sig, code):
    """Ctrl-C (or a job stop's SIGTERM) while the engine generates: exit 128 + signal within
    5 s, one line saying so, and no file under the output's name (nor a temporary one)."""
    model = tiny_model("llama")
    dst = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "ray_runtime", "generate", "--model", model,
           "--pipeline-parallel-size", "2", "--input", str(_long_job(tmp_path, model)),
           "--output", str(dst), "--max-tokens", "460", "--ignore-eos"]
    env = _env()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "generating" not in line:  # the engine is up and the call is running
            assert time.monotonic() < deadline, "the CLI never started generating"
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(1)
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc == code, err[-3000:]
    assert took < 5, f"took {took:.1f}s to stop"
    assert f"interrupted by {signal.Signals(sig).name}" in err
    assert not dst.exists() and not list(tmp_path.glob("out.jsonl.tmp.*"))
