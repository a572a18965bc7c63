"""The caller's side of outputs (ray_runtime/output_processor.py, detokenizer.py): text as
tokens arrive across multi-byte characters, stop strings, n > 1 and the output kinds, on the
tiny byte-level tokenizer (tests/tiny_models.py), from synthetic engine deltas."""
import random

import pytest

from ray_runtime.detokenizer import IncrementalDetokenizer
from ray_runtime.messages import RequestDelta
from ray_runtime.output_processor import OutputProcessor, child_ids, child_params
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams
from tests.tiny_models import make_tiny_model_with_tokenizer

DELTA, CUMULATIVE, FINAL = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                            RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def tok(tiny_root):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model_with_tokenizer("llama", tiny_root))


@pytest.mark.parametrize("seed", range(40))
def test_incremental_text_equals_decode_for_any_chunking(tok, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(0, 384) for _ in range(rng.randint(1, 60))]
    d = IncrementalDetokenizer(tok)
    parts, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 4)
        parts.append(d.push(ids[i:i + k]))
        i += k
    parts.append(d.finish())
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=True)


def test_a_character_split_over_tokens_appears_once_complete(tok):
    ids = tok("a€", add_special_tokens=False).input_ids  # "€" is 3 bytes, not in the corpus
    assert len(ids) >= 3, ids
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([t]) for t in ids]
    assert pieces[0] == "a" and all(p == "" for p in pieces[1:-1]) and pieces[-1] == "€"
    assert d.finish() == ""


def _proc(tok, sp, rid="r", prompt=(5, 6)):
    p = OutputProcessor(tok)
    ids = child_ids(rid, sp.n)
    p.add(rid, None, list(prompt), sp, ids, [child_params(sp, i, sp.n) for i in range(sp.n)])
    return p, ids


def _feed(p, rid, token_ids, chunk=1, finish_reason="length"):
    outs, aborts = [], []
    for i in range(0, len(token_ids), chunk):
        last = i + chunk >= len(token_ids)
        o, a = p.process([RequestDelta(rid, token_ids[i:i + chunk], last,
                                       finish_reason if last else None)])
        outs += o
        aborts += a
        if a:
            break
    return outs, aborts


def test_stop_string_ends_the_text_and_aborts_the_request(tok):
    text = "hello world, hello ray"
    ids = tok(text, add_special_tokens=False).input_ids
    sp = SamplingParams(stop=[", he"], output_kind=DELTA, max_tokens=50)
    p, (eid,) = _proc(tok, sp)
    outs, aborts = _feed(p, eid, ids)
    assert aborts == [eid]
    got = "".join(o.outputs[0].text for o in outs)
    assert got == "hello world"
    last = outs[-1].outputs[0]
    assert outs[-1].finished and last.finish_reason == "stop" and last.stop_reason == ", he"
    # the engine's later deltas for the aborted request are dropped
    assert p.process([RequestDelta(eid, [5], True, "abort")]) == ([], [])


def test_streamed_text_never_shows_part_of_a_stop_string(tok):
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok(text, add_special_tokens=False).input_ids
    sp = SamplingParams(stop=["lazy dog"], output_kind=DELTA, max_tokens=50)
    p, (eid,) = _proc(tok, sp)
    outs, _ = _feed(p, eid, ids)
    shown = ""
    for o in outs[:-1]:
        shown += o.outputs[0].text
        assert "lazy" not in shown, shown  # held back until it is known not to be a stop
    shown += outs[-1].outputs[0].text
    assert shown == "the quick brown fox jumps over the "
    assert outs[-1].outputs[0].stop_reason == "lazy dog"
    # shown anyway with include_stop_str_in_output: nothing is held back (as vLLM)
    sp = SamplingParams(stop=["lazy dog"], output_kind=DELTA, max_tokens=50,
                        include_stop_str_in_output=True)
    p, (eid,) = _proc(tok, sp)
    outs, _ = _feed(p, eid, ids)
    assert "".join(o.outputs[0].text for o in outs) == text


def test_n_children_aggregate_and_seed_each(tok):
    sp = SamplingParams(n=3, seed=10, output_kind=FINAL, max_tokens=4)
    assert [child_params(sp, i, 3).seed for i in range(3)] == [10, 11, 12]
    p, ids = _proc(tok, sp, rid="x")
    assert ids == ["0_x", "1_x", "2_x"]
    outs = []
    for i, eid in enumerate(ids):
        outs += p.process([RequestDelta(eid, [10 + i, 20 + i], True, "length")])[0]
    assert len(outs) == 1 and outs[0].finished  # FINAL_ONLY: once, when all three are done
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert [c.token_ids for c in outs[0].outputs] == [[10, 20], [11, 21], [12, 22]]


def test_cumulative_outputs_extend_and_an_error_is_carried(tok):
    ids = tok("pipeline parallel", add_special_tokens=False).input_ids
    p, (eid,) = _proc(tok, SamplingParams(output_kind=CUMULATIVE, max_tokens=50))
    outs, _ = _feed(p, eid, ids, chunk=2)
    for a, b in zip(outs, outs[1:]):
        assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert outs[-1].outputs[0].text == "pipeline parallel"
    p2, (e2,) = _proc(tok, SamplingParams(output_kind=DELTA), rid="y")
    (out,), _ = p2.process([RequestDelta(e2, [], True, "abort", error="StageError: boom")])
    assert out.error == "StageError: boom" and out.finished


def test_a_stop_string_in_the_final_delta_aborts_nothing(tok):
    """The engine finished the request in the same delta: no abort is sent (an abort of a
    finished id would only be late)."""
    ids = tok("hello world, hello ray", add_special_tokens=False).input_ids
    p, (eid,) = _proc(tok, SamplingParams(stop=["ray"], output_kind=FINAL, max_tokens=50))
    outs, aborts = p.process([RequestDelta(eid, ids, True, "length")])
    assert aborts == [] and outs[0].outputs[0].text == "hello world, hello "
    assert outs[0].outputs[0].finish_reason == "stop"


def test_an_engine_id_in_use_is_found(tok):
    p, ids = _proc(tok, SamplingParams(n=2), rid="x")
    assert p.in_use(["0_x"]) == "0_x" and p.in_use(["x"]) is None
