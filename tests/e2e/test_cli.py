"""`python -m ray_runtime generate`, the `ray job submit` entrypoint, end to end: jsonl in,
jsonl out, joining the running cluster."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT, stress_workload
from tests.reference import assert_matches, hf_greedy


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
    env = {**os.environ, "PYTHONPATH": ROOT}
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
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "top_p" in proc.stderr


def test_cli_rejects_bad_speculative_config_with_exit_2(tiny_model, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6]}) + "\n")
    for bad, field in [("{not json", "--speculative-config"),
                       ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens")]:
        cmd = [sys.executable, "-m", "ray_runtime", "generate", "--model", tiny_model("mistral"),
               "-pp", "1", "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
               "--speculative-config", bad]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and field in proc.stderr, proc.stderr[-2000:]


def test_cli_rejects_bad_max_inflight_steps_with_exit_2(tiny_model, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6]}) + "\n")
    cmd = [sys.executable, "-m", "ray_runtime", "generate", "--model", tiny_model("mistral"),
           "-pp", "1", "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
           "--max-inflight-steps", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "max_inflight_steps" in proc.stderr, proc.stderr[-2000:]
