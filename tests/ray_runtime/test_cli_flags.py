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
    # flags not given do not reach the LLM: EngineConfig's defaults apply, as for LLM(model)
    assert set(seen) == {"model", "tokenizer"}


def test_every_engine_option_is_a_flag_with_the_config_default(tmp_path):
    """One source of truth: the CLI makes a flag of every EngineConfig field, and with no
    flags the config equals EngineConfig's defaults (what LLM(model) gets)."""
    import dataclasses

    from ray_runtime.cli_args import engine_kwargs
    from ray_runtime.config import EngineConfig

    parser = argparse.ArgumentParser()
    cli._engine_args(parser)
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= dests
    model = str(tmp_path)
    assert EngineConfig.from_kwargs(model, **engine_kwargs(parser.parse_args([]))) == \
        EngineConfig(model=model)
    args = parser.parse_args(["-pp", "3", "--sync", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2}',
                              "--pp-layer-partition", "2,2,1", "--no-enforce-eager"])
    cfg = EngineConfig.from_kwargs(model, **engine_kwargs(args))
    assert cfg.pipeline_parallel_size == 3 and cfg.async_scheduling is False
    assert cfg.speculative_config.num_speculative_tokens == 2
    assert cfg.pp_layer_partition == (2, 2, 1) and cfg.enforce_eager is False
