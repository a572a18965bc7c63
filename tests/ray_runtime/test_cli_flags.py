"""The CLI's cluster and metrics flags reach the engine's config (ray_runtime/__main__.py)."""
import argparse

from ray_runtime import __main__ as cli


def _parse(argv):
    parser = argparse.ArgumentParser()
    cli._engine_args(parser)
    return parser.parse_args(argv)


def test_flags_reach_the_llm(monkeypatch, tmp_path):
    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    import ray_runtime.api

    monkeypatch.setattr(ray_runtime.api, "LLM", FakeLLM)
    monkeypatch.setattr(cli, "_install_signal_handlers", lambda: None)
    cli.build_llm(_parse(["--model", str(tmp_path), "--address", "10.0.0.1:6379",
                          "--disable-log-stats", "--num-cpus-per-stage", "0.5"]))
    assert seen["address"] == "10.0.0.1:6379"
    assert seen["disable_log_stats"] is True and seen["num_cpus_per_stage"] == 0.5
    seen.clear()
    cli.build_llm(_parse(["--model", str(tmp_path)]))
    assert seen["address"] is None and seen["disable_log_stats"] is False
    assert seen["num_cpus_per_stage"] == 1.0
