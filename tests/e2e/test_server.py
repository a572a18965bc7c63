"""The OpenAI-compatible server (ray_runtime/server/) on Ray Serve, end to end: one Serve app
(PP=2 tiny Llama with a tokenizer) for the module on an OS-chosen port, queried with the
official `openai` client and raw HTTP. Greedy token ids equal the HF reference; streams equal
their non-streamed results; concurrent streams lose, repeat or reorder nothing; bad fields
are 400s naming the field; a client that disconnects mid-stream frees its request."""
import asyncio
import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import openai
import pytest

from tests.reference import assert_matches, hf_greedy
from tests.tiny_models import VOCAB, make_tiny_model_with_tokenizer

APP, NAME = "ray_pp_test_server", "tiny-llama"
MAX_MODEL_LEN, NUM_KV_BLOCKS = 512, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_root):
    from ray import serve
    from transformers import AutoTokenizer

    from ray_runtime.server.app import build_app

    model = make_tiny_model_with_tokenizer("llama", tiny_root)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"model": model, "pipeline_parallel_size": 2,
                             "max_num_batched_tokens": 64, "num_kv_blocks": NUM_KV_BLOCKS,
                             "max_model_len": MAX_MODEL_LEN, "served_model_name": NAME}),
                  name=APP, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        yield SimpleNamespace(url=url, model=model, handle=serve.get_app_handle(APP),
                              tok=AutoTokenizer.from_pretrained(model),
                              client=openai.OpenAI(base_url=url + "/v1", api_key="none",
                                                   max_retries=0, timeout=60))
    finally:
        serve.shutdown()


def _post(url: str, body, path: str = "/v1/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stats(server) -> dict:
    return server.handle.engine_stats.remote().result(timeout_s=30)


GREEDY = dict(temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})


def test_completion_greedy_equals_hf_and_stream_equals_non_stream(server):
    prompt, n = [5, 17, 33, 99, 140, 201, 7], 10
    r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=n, logprobs=2,
                                         **GREEDY)
    c = r.choices[0]
    assert_matches(c.token_ids, hf_greedy(server.model, tuple(prompt), n), "completion")
    assert c.text == server.tok.decode(c.token_ids, skip_special_tokens=True)
    assert c.finish_reason == "length" and r.model == NAME and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (7, n, 7 + n)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen is the best
        assert chosen <= 0 and abs(max(top.values()) - chosen) < 1e-5

    chunks = list(server.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=n, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    body = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in body) == c.text
    assert [t for ch in body for t in ch.choices[0].token_ids] == c.token_ids
    assert [ch.choices[0].finish_reason for ch in body][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    assert chunks[-1].usage.completion_tokens == n and not chunks[-1].choices


def test_chat_and_chat_stream(server):
    messages = [{"role": "user", "content": "hello world"}]
    text = server.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = server.tok(text, add_special_tokens=False).input_ids
    r = server.client.chat.completions.create(model=NAME, messages=messages,
                                              max_completion_tokens=8, **GREEDY)
    c = r.choices[0]
    assert_matches(c.token_ids, hf_greedy(server.model, tuple(ids), 8), "chat")
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert c.message.content == server.tok.decode(c.token_ids, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion"
    chunks = list(server.client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=8, stream=True, logprobs=True,
        top_logprobs=1, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    lps = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(lps) == 8 and all(e.top_logprobs[0].logprob == e.logprob for e in lps)


def test_n_seed_and_stop_string(server):
    prompt = [9, 8, 7, 6, 5]
    kw = dict(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, n=2, seed=11)
    a, b = (server.client.completions.create(**kw) for _ in range(2))
    assert sorted(ch.index for ch in a.choices) == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices], "seeded: reproducible"
    full = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                            **GREEDY).choices[0].text
    stop = full[4:6]
    expected = full[:full.find(stop)]
    got = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, stop=[stop],
                                           **GREEDY).choices[0]
    assert (got.text, got.finish_reason) == (expected, "stop")
    streamed = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                                stop=stop, stream=True, **GREEDY)
    assert "".join(ch.choices[0].text for ch in streamed) == expected


def test_models_and_health(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == [NAME]
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200


def test_concurrent_streams_lose_repeat_or_reorder_nothing(server):
    import random

    rng = random.Random(5)
    reqs = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))], rng.randint(4, 12))
            for _ in range(16)]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=60)

    async def one(prompt, n):
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=n,
                                                 stream=True, **GREEDY)
        text, ids = "", []
        async for ch in stream:
            text += ch.choices[0].text
            ids += ch.choices[0].token_ids
        return text, ids

    async def all_of_them():
        return await asyncio.wait_for(asyncio.gather(*(one(p, n) for p, n in reqs)), 120)

    results = asyncio.run(all_of_them())
    for i, ((prompt, n), (text, ids)) in enumerate(zip(reqs, results)):
        assert len(ids) == n
        assert_matches(ids, hf_greedy(server.model, tuple(prompt), n), f"stream {i}")
        assert text == server.tok.decode(ids, skip_special_tokens=True), f"stream {i}"


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": [5] * MAX_MODEL_LEN}, "prompt"),  # too long
    ("/v1/completions", {"prompt": [5, VOCAB]}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),  # missing
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": True}, "seed"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": "x"}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content"),
    ("/v1/completions", b"{not json", None),
])
def test_bad_request_is_a_400_naming_the_field_and_the_server_keeps_serving(
        server, path, body, param):
    status, err = _post(server.url, body, path)
    assert status == 400, err
    assert err["error"]["type"] == "BadRequestError" and err["error"]["code"] == 400
    assert err["error"]["param"] == param, err
    if param is not None:
        assert param in err["error"]["message"]
    status, ok = _post(server.url, {"prompt": [5, 6], "max_tokens": 2, "temperature": 0})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def test_openai_client_raises_bad_request_error(server):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        server.client.completions.create(model=NAME, prompt="hi", top_p=7.0)


def _driver():
    """The server's engine driver, found by its actor name (ray_runtime/cluster.py)."""
    import ray

    found = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("ray_pp-") and a["name"].endswith("-driver")]
    assert len(found) == 1, f"expected the server's driver alone, found {found}"
    return ray.get_actor(found[0]["name"], namespace=found[0]["namespace"])


@pytest.fixture
def slow_steps(server):
    """Every step of rank 1 takes >= 20 ms while the test runs, so a 500-token request lasts
    >= 10 s: a hang-up is seen long before it could finish, on a machine of any speed."""
    import ray

    from tests.e2e.faults import SlowSteps

    driver = _driver()
    ray.get(driver.set_fault_hook.remote(1, SlowSteps(0.02)))
    try:
        yield
    finally:
        ray.get(driver.set_fault_hook.remote(1, None))


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(server, slow_steps, stream):
    before = _stats(server)
    max_tokens = MAX_MODEL_LEN - 10
    host, port = server.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "prompt": list(range(3, 13)), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream}), {"Content-Type": "application/json"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        seen = 0
        while seen < 2:  # two events, then hang up
            if resp.fp.readline().startswith(b"data: "):
                seen += 1
    else:  # hang up while it runs
        deadline = time.time() + 30
        while _stats(server)["num_requests_running"] == 0:
            assert time.time() < deadline, "the request never started"
            time.sleep(0.05)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 30
    while True:
        s = _stats(server)
        if s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0:
            break
        assert time.time() < deadline, f"the request still runs 30 s after the disconnect: {s}"
        time.sleep(0.2)
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] == NUM_KV_BLOCKS
    generated = s["num_generated_tokens"] - before["num_generated_tokens"]
    assert generated < max_tokens, "the request ran to its end instead of being aborted"
    server.handle.engine_check.remote().result(timeout_s=30)
    assert s["bookkeeping_mismatches"] == 0


def test_bench_serving_smoke(server, tmp_path, monkeypatch):
    from bench import serving

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    serving.main(["--url", server.url, "--model-name", NAME, "--vocab-size", str(VOCAB),
                  "--request-rates", "20", "inf", "--num-prompts", "4", "--prompt-len", "8",
                  "--output-len", "4", "--tag", "ci"])
    with open(tmp_path / "serving_ci.json") as f:
        r = json.load(f)
    assert r["bench"] == "serving_ci"
    assert [row["request_rate"] for row in r["rows"]] == [20.0, "inf"]
    for row in r["rows"]:
        assert row["completed"] == 4 and row["failed"] == 0
        assert row["output_tokens"] == 16
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert set(row[key]) == {"mean", "p50", "p99"} and row[key]["p50"] > 0
        assert row["request_throughput"] > 0 and row["output_tok_s"] > 0


def test_metrics_show_the_engine_and_serve_series(server):
    """Last in the module: Ray exports metrics every few seconds, and by now the earlier
    tests' requests have been recorded (this one sends one more, to stand alone)."""
    assert _post(server.url, {"prompt": [5, 6], "max_tokens": 2})[0] == 200
    want = ("ray_ray_pp_generation_tokens_total", "ray_serve_num_http_requests_total")
    deadline = time.time() + 60
    while True:
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
            ctype = r.headers["Content-Type"]
        if all(f"# TYPE {w} " in text for w in want):
            break
        assert time.time() < deadline, text[-2000:]
        time.sleep(2)
    assert ctype.startswith("text/plain")
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)), "one TYPE line per family"
    assert all(n.startswith(("ray_ray_pp_", "ray_serve_")) for n in types)
    assert 'model_name="%s"' % server.model in text, "the engine's series carry its tags"
