"""The online engine (AsyncLLM): requests join while others decode, outputs stream, aborts
free everything. Streaming must equal non-streaming and the HF reference, token for token."""
import asyncio
import random

import pytest

from ray_runtime import SamplingParams
from ray_runtime.async_llm import AsyncLLM
from ray_runtime.output_processor import RequestFailed
from ray_runtime.sampling_params import RequestOutputKind
from tests.reference import Reference, assert_matches, hf_greedy
from tests.tiny_models import make_tiny_model_with_tokenizer

DELTA, CUMULATIVE, FINAL = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                            RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def tok_model(tiny_root):
    return make_tiny_model_with_tokenizer("llama", tiny_root)


def _greedy(max_tokens, kind, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          output_kind=kind, **kw)


async def _collect(engine, prompt, sp, rid, started=None, after=None):
    """Every output of one request; `started` is set once it has `after` tokens."""
    outs = []
    async for out in engine.generate(prompt, sp, rid):
        outs.append(out)
        if started is not None and sum(len(o.outputs[0].token_ids) for o in outs) >= after:
            started.set()
    return outs


def _check_stream(outs, kind, ref_ids, tokenizer, what):
    assert outs[-1].finished and all(not o.finished for o in outs[:-1]), what
    final = outs[-1].outputs[0]
    if kind == DELTA:
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in outs)
    else:
        ids, text = list(final.token_ids), final.text
        if kind == CUMULATIVE:  # every output extends the previous one
            for a, b in zip(outs, outs[1:]):
                assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
        else:
            assert len(outs) == 1, what
    assert_matches(ids, ref_ids, what)
    assert text == tokenizer.decode(ids, skip_special_tokens=True), what
    return ids


@pytest.mark.parametrize("pp", [1, 2])
def test_streaming_equals_reference_with_requests_joining_mid_decode(ray_cluster, tok_model, pp):
    rng = random.Random(pp)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (40, 7, 55, 23, 31)]
    budgets = [30, 12, 9, 16, 20]
    kinds = [DELTA, CUMULATIVE, FINAL, DELTA, CUMULATIVE]
    engine = AsyncLLM(tok_model, pipeline_parallel_size=pp, max_num_batched_tokens=32)
    try:
        async def main():
            started = asyncio.Event()
            first = asyncio.create_task(_collect(
                engine, {"prompt_token_ids": prompts[0]}, _greedy(budgets[0], kinds[0]), "r0",
                started, after=6))
            await started.wait()  # r0 is mid-decode: the others join it
            rest = [asyncio.create_task(_collect(engine, {"prompt_token_ids": p},
                                                 _greedy(m, k), f"r{i}"))
                    for i, (p, m, k) in enumerate(zip(prompts, budgets, kinds)) if i]
            return [await first] + [await t for t in rest]

        results = asyncio.run(main())
        for i, outs in enumerate(results):
            ref = hf_greedy(tok_model, tuple(prompts[i]), budgets[i], eos=False)
            _check_stream(outs, kinds[i], ref, engine.tokenizer, f"pp={pp} request {i}")
        engine.check()
        stats = engine.stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert stats["num_requests_finished"] == len(prompts)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def online(ray_cluster, tok_model):
    engine = AsyncLLM(tok_model, pipeline_parallel_size=2, max_num_batched_tokens=24,
                      max_num_seqs=3, num_kv_blocks=40,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_abort_at_random_points_frees_everything(online, tok_model, seed):
    """Aborts while waiting (max_num_seqs=3 keeps some queued), mid-prefill (long prompts in
    24-token chunks), mid-decode, with ngram drafts in flight: each aborted stream ends with
    finish_reason "abort"; the others equal the reference; KV blocks and rank slots are free."""
    rng = random.Random(seed)
    n = 8
    prompts = [[rng.randrange(3, 384) for _ in range(rng.choice((5, 30, 70)))] for _ in range(n)]
    prompts[1] = [11, 12, 13] * 10  # repetitive: the ngram proposer drafts for it
    budgets = [rng.randint(4, 24) for _ in range(n)]
    victims = set(rng.sample(range(n), 4))
    delays = {i: rng.choice((0.0, 0.005, 0.02, 0.05)) for i in victims}

    async def main():
        tasks = [asyncio.create_task(_collect(online, {"prompt_token_ids": p}, _greedy(m, DELTA),
                                              f"s{seed}-{i}"))
                 for i, (p, m) in enumerate(zip(prompts, budgets))]
        for i in sorted(victims, key=delays.get):
            await asyncio.sleep(delays[i])
            await online.abort(f"s{seed}-{i}")
        return [await t for t in tasks]

    results = asyncio.run(main())
    aborted = 0
    for i, outs in enumerate(results):
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        reason = outs[-1].outputs[0].finish_reason
        ref = hf_greedy(tok_model, tuple(prompts[i]), budgets[i], eos=False)
        if reason == "abort":
            assert i in victims
            aborted += 1
            # what it produced before the abort is a prefix of the reference
            assert_matches(ids, Reference(ref.token_ids[:len(ids)], ref.top2_gap[:len(ids)]),
                           f"aborted request {i}")
        else:
            assert reason == "length", (i, reason)
            assert_matches(ids, ref, f"request {i}")
    assert aborted >= 1, "no abort landed before its request finished"
    online.check()  # scheduler, block pool, and every rank holds exactly the driver's view
    stats = online.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_abandoned_stream_aborts_its_request(online):
    """A consumer that stops iterating (a client that disconnects) aborts its request."""
    async def main():
        gen = online.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(400, DELTA), "gone")
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(100):
            if online.stats()["num_requests_running"] == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(main()), "the abandoned request kept running"
    online.check()


def test_duplicate_request_id_and_bad_input_fail_in_the_caller(online):
    async def main():
        gen = online.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(200, DELTA), "dup")
        await gen.__anext__()
        with pytest.raises(ValueError, match="dup"):
            async for _ in online.generate({"prompt_token_ids": [5]}, _greedy(2, DELTA), "dup"):
                pass
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in online.generate([5], SamplingParams(max_tokens=0), "bad"):
                pass
        await gen.aclose()
        assert await online.check_health()
        outs = await _collect(online, {"prompt_token_ids": [5, 6, 7]}, _greedy(3, FINAL), "after")
        return outs

    outs = asyncio.run(main())
    assert len(outs[-1].outputs[0].token_ids) == 3


def test_engine_failure_fails_the_stream_and_the_engine_serves_on(ray_cluster, tok_model):
    """A stage error mid-decode fails the streams that were running (RequestFailed naming the
    stage), and the next request is served correctly."""
    from tests.e2e.faults import RaiseAtStep

    engine = AsyncLLM(tok_model, pipeline_parallel_size=2)
    try:
        engine._set_fault_hook(1, RaiseAtStep(3))

        async def main():
            with pytest.raises(RequestFailed, match="stage rank 1"):
                await _collect(engine, {"prompt_token_ids": [5, 6, 7]}, _greedy(20, DELTA), "f")
            engine._set_fault_hook(1, None)
            return await _collect(engine, {"prompt_token_ids": [5, 6, 7]}, _greedy(6, FINAL), "g")

        outs = asyncio.run(main())
        assert_matches(list(outs[-1].outputs[0].token_ids),
                       hf_greedy(tok_model, (5, 6, 7), 6, eos=False), "after the failure")
    finally:
        engine.shutdown()


def test_stats_and_health_answer_while_a_stage_stalls(ray_cluster, tok_model):
    """A stage stalls mid-stream: stats() and health() still answer at once (the driver's
    loop runs beside its actor threads); past step_timeout_s the stage is replaced and the
    stream finishes with the reference tokens."""
    import time

    from tests.e2e.faults import StallAtStep

    engine = AsyncLLM(tok_model, pipeline_parallel_size=2, step_timeout_s=6.0,
                      max_stage_restarts=1)
    try:
        engine._set_fault_hook(1, StallAtStep(3, 25.0))

        async def main():
            task = asyncio.create_task(_collect(
                engine, {"prompt_token_ids": [5, 6, 7]}, _greedy(12, DELTA), "stalled"))
            await asyncio.sleep(3.0)  # the stall has begun, the deadline not yet passed
            t0 = time.monotonic()
            stats = engine.stats()
            health = await engine.health()
            took = time.monotonic() - t0
            return await task, stats, health, took

        outs, stats, health, took = asyncio.run(main())
        assert took < 2.0, f"stats() and health() took {took:.1f}s during a stall"
        assert health["busy"] and stats["num_requests_running"] == 1
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        assert_matches(ids, hf_greedy(tok_model, (5, 6, 7), 12, eos=False), "after the stall")
        assert engine.stats()["num_stage_restarts"] == 1
    finally:
        engine.shutdown()


def test_stop_strings_and_n_against_the_reference(online, tok_model):
    """A stop string ends the text where the reference's text first shows it (token ids: a
    prefix of the reference); n=2 greedy gives the reference twice; n=2 seeded gives, for
    child i, what a single request with seed + i gives."""
    tokenizer = online.tokenizer
    prompt = [7, 8, 9, 10, 11]
    ref = hf_greedy(tok_model, tuple(prompt), 16, eos=False)
    text = tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    cut = text.index(stop)

    async def one(sp, rid):
        return (await _collect(online, {"prompt_token_ids": prompt}, sp, rid))[-1]

    async def main():
        stopped = await one(_greedy(16, FINAL, stop=[stop]), "stop-a")
        streamed = await _collect(online, {"prompt_token_ids": prompt},
                                  _greedy(16, DELTA, stop=[stop]), "stop-b")
        both = await one(_greedy(16, FINAL, n=2), "n-greedy")
        seeded = await one(SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=2,
                                          ignore_eos=True, output_kind=FINAL), "n-seeded")
        singles = [await one(SamplingParams(max_tokens=8, temperature=1.0, seed=5 + i,
                                            ignore_eos=True, output_kind=FINAL), f"single-{i}")
                   for i in range(2)]
        return stopped, streamed, both, seeded, singles

    stopped, streamed, both, seeded, singles = asyncio.run(main())
    c = stopped.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text[:cut], "stop", stop)
    assert list(c.token_ids) == ref.token_ids[:len(c.token_ids)]
    assert "".join(o.outputs[0].text for o in streamed) == text[:cut]
    assert [list(x.token_ids) for x in both.outputs] == [ref.token_ids] * 2
    assert [list(x.token_ids) for x in seeded.outputs] == \
        [list(s.outputs[0].token_ids) for s in singles]
    online.check()


def test_shutdown_ends_the_streams_still_running(ray_cluster, tok_model):
    engine = AsyncLLM(tok_model, max_num_batched_tokens=32)

    async def main():
        gen = engine.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(400, DELTA), "long")
        await gen.__anext__()
        engine.shutdown()
        with pytest.raises(RequestFailed, match="shut down"):
            async for _ in gen:
                pass

    asyncio.run(main())
