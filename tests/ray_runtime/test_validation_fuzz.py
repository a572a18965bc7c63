"""Fuzz of the caller-side checks (SamplingParams, validate_request, generate()'s argument
handling), no Ray needed: every bad input raises ValueError / TypeError naming the field, and
every good one passes, converted to plain types that survive the wire format (msgpack)."""
from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_runtime.messages import (CachedRequestData, NewRequestData, RequestSpec, StepPlan,
                                  decode_plan, encode)
from ray_runtime.sampling_params import SAMPLING_EPS, SamplingParams
from ray_runtime.validation import as_params_list, as_prompt_list, parse_prompt, validate_request

I64_MIN, I64_MAX = -(2 ** 63), 2 ** 63 - 1
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- strategies --------------------------------------------------------------------------

huge_ints = st.one_of(st.integers(min_value=2 ** 63), st.integers(max_value=I64_MIN - 1),
                      st.sampled_from([2 ** 64, 2 ** 64 - 1, -(2 ** 64), 10 ** 400]))
non_finite = st.sampled_from([math.nan, math.inf, -math.inf, np.float64("nan"), np.float32("inf")])
bools = st.one_of(st.booleans(), st.sampled_from([np.bool_(True), np.bool_(False)]))
junk = st.one_of(st.none(), st.text(max_size=5), st.binary(max_size=3), st.just([]), st.just({}),
                 st.just(1j), st.just(object()), st.just("1"), st.just("yes"), st.just("True"))


def np_int(values: st.SearchStrategy) -> st.SearchStrategy:
    """The same integers, some as numpy integers (accepted and converted)."""
    return st.one_of(values, values.filter(lambda v: I64_MIN <= v <= I64_MAX).map(np.int64))


def ints(lo: int, hi: int) -> st.SearchStrategy:
    return np_int(st.integers(lo, hi))


def numbers(lo: float, hi: float, exclude_min: bool = False) -> st.SearchStrategy:
    floats = st.floats(lo, hi, exclude_min=exclude_min)
    whole = st.integers(math.ceil(lo), math.floor(hi)).filter(lambda v: v > lo or not exclude_min)
    return st.one_of(floats, floats.map(np.float64), whole)


int_junk = st.one_of(junk, bools, st.floats(allow_nan=True), st.just(3.0), huge_ints)
float_junk = st.one_of(junk, bools, non_finite, st.just(10 ** 400))
bool_junk = st.one_of(junk, st.integers(), st.floats(), st.sampled_from([0, 1, "false"]))
int_list_junk = st.one_of(
    junk.filter(lambda v: not isinstance(v, list)), st.just({1, 2}), st.just(range(3)),
    st.lists(st.integers(0, 100), max_size=3).map(lambda xs: xs + [True]),
    st.lists(st.integers(0, 100), max_size=3).map(lambda xs: [*xs, 1.0]),
    st.lists(st.integers(0, 100), max_size=3).map(lambda xs: [*xs, None]),
    st.lists(st.integers(0, 100), max_size=3).map(lambda xs: [*xs, "7"]),
    st.just(np.array([1.0, 2.0])), st.just(np.array([True])), st.just(np.zeros((2, 2), np.int64)))

STOP_STR = st.text(min_size=1, max_size=6)
PENALTY_JUNK = st.one_of(float_junk, st.floats(max_value=-2.0, exclude_max=True),
                         st.floats(min_value=2.0, exclude_min=True),
                         st.integers(max_value=-3), st.integers(min_value=3))

# field: (good values, bad values)
FIELDS = {
    "max_tokens": (ints(1, I64_MAX), st.one_of(int_junk, st.integers(max_value=0))),
    "temperature": (numbers(0.0, 1e300),
                    st.one_of(float_junk, st.floats(max_value=-1e-300), st.integers(max_value=-1))),
    "top_p": (numbers(0.0, 1.0, exclude_min=True),
              st.one_of(float_junk, st.floats(max_value=0.0),
                        st.floats(min_value=1.0, exclude_min=True),
                        st.integers(max_value=0), st.integers(min_value=2))),
    "top_k": (ints(-1, I64_MAX), st.one_of(int_junk, st.integers(max_value=-2))),
    "min_p": (numbers(0.0, 1.0), st.one_of(float_junk, st.floats(max_value=-1e-300),
                                           st.floats(min_value=1.0, exclude_min=True))),
    "seed": (st.one_of(st.none(), ints(I64_MIN, I64_MAX)),
             int_junk.filter(lambda v: v is not None)),
    "ignore_eos": (bools, bool_junk),
    "stop_token_ids": (st.one_of(st.lists(ints(0, I64_MAX), max_size=4),
                                 st.tuples(ints(0, 99), ints(0, 99)),
                                 st.lists(st.integers(0, 99), max_size=4).map(np.array)),
                       st.one_of(int_list_junk,
                                 st.lists(st.integers(0, 9), max_size=3).map(lambda xs: [*xs, -1]),
                                 huge_ints.map(lambda v: [v]))),
    "logprobs": (st.one_of(st.none(), ints(0, 20)),
                 st.one_of(int_junk.filter(lambda v: v is not None), st.integers(max_value=-1),
                           st.integers(min_value=21))),
    "detokenize": (bools, bool_junk),
    "n": (ints(1, 128), st.one_of(int_junk, st.integers(max_value=0), st.integers(min_value=129))),
    "stop": (st.one_of(st.none(), STOP_STR, st.lists(STOP_STR, max_size=4),
                       st.lists(STOP_STR, min_size=1, max_size=3).map(tuple),
                       st.just(["s"] * 64), st.just(["s" * 1024])),
             st.one_of(junk.filter(lambda v: v is not None and not isinstance(v, (str, list))),
                       st.just(""), st.integers(), bools, st.floats(), st.just({"a"}),
                       st.lists(STOP_STR, max_size=3).map(lambda xs: [*xs, ""]),
                       st.lists(STOP_STR, max_size=3).map(lambda xs: [*xs, 7]),
                       st.lists(STOP_STR, max_size=3).map(lambda xs: [*xs, None]),
                       st.lists(STOP_STR, max_size=3).map(lambda xs: [*xs, b"x"]),
                       st.lists(STOP_STR, max_size=3).map(lambda xs: [*xs, ["x"]]),
                       st.just(["s"] * 65), st.just(["s" * 1025]))),
    "include_stop_str_in_output": (bools, bool_junk),
    "presence_penalty": (numbers(-2.0, 2.0), PENALTY_JUNK),
    "frequency_penalty": (numbers(-2.0, 2.0), PENALTY_JUNK),
    "repetition_penalty": (numbers(0.0, 2.0, exclude_min=True),
                           st.one_of(float_junk, st.floats(max_value=0.0),
                                     st.floats(min_value=2.0, exclude_min=True),
                                     st.integers(max_value=0), st.integers(min_value=3))),
}
WIRE_TYPES = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int,
              "min_p": float, "ignore_eos": bool, "detokenize": bool, "n": int,
              "include_stop_str_in_output": bool, "presence_penalty": float,
              "frequency_penalty": float, "repetition_penalty": float}


@st.composite
def good_kwargs(draw) -> dict:
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True))
    return {name: draw(FIELDS[name][0]) for name in names}


def check_good(sp: SamplingParams) -> None:
    """Plain wire types, and a msgpack round trip through what the driver sends the stages."""
    for name, typ in WIRE_TYPES.items():
        assert type(getattr(sp, name)) is typ, (name, getattr(sp, name))
    assert sp.seed is None or type(sp.seed) is int
    assert sp.logprobs is None or type(sp.logprobs) is int
    assert type(sp.stop_token_ids) is list and all(type(t) is int for t in sp.stop_token_ids)
    assert type(sp.stop) is list and all(type(s) is str and s for s in sp.stop)
    assert sp.uses_penalties == (sp.presence_penalty != 0 or sp.frequency_penalty != 0
                                 or sp.repetition_penalty != 1)
    assert sp.is_greedy == (sp.temperature < SAMPLING_EPS)
    plan = StepPlan(step_id=0, removed_req_ids=[], cached_reqs=CachedRequestData(), scheduled_req_ids=["r"],
                    num_scheduled_tokens=[1],
                    new_reqs=[NewRequestData(req_id="r", incarnation=0, token_ids=[1],
                                             num_prompt_tokens=1, num_computed_tokens=0,
                                             block_ids=[0], sampling=sp)])
    assert decode_plan(encode(plan)).new_reqs[0].sampling == sp


def raises_naming(field: str, call) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert field in str(info.value), (field, str(info.value))


# ---- SamplingParams ----------------------------------------------------------------------

@FUZZ
@given(kwargs=good_kwargs())
def test_good_sampling_params_pass_and_fit_the_wire(kwargs):
    sp = SamplingParams(**kwargs)
    check_good(sp)
    sp.validate()  # idempotent
    check_good(sp)


@FUZZ
@given(data=st.data(), kwargs=good_kwargs(), field=st.sampled_from(sorted(FIELDS)),
       after_construction=st.booleans())
def test_bad_sampling_params_field_is_named(data, kwargs, field, after_construction):
    bad = data.draw(FIELDS[field][1], label=field)
    if after_construction:  # set after construction: validate() (as generate() runs it) refuses
        sp = SamplingParams(**kwargs)
        setattr(sp, field, bad)
        raises_naming(f"SamplingParams.{field}", sp.validate)
    else:
        raises_naming(f"SamplingParams.{field}", lambda: SamplingParams(**{**kwargs, field: bad}))


@pytest.mark.parametrize("kwargs,field", [
    (dict(seed=True), "seed"), (dict(max_tokens=True), "max_tokens"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(seed=2 ** 64), "seed"),
    (dict(seed=2 ** 63), "seed"), (dict(stop_token_ids=[2 ** 64]), "stop_token_ids"),
    (dict(stop_token_ids=None), "stop_token_ids"), (dict(max_tokens=2 ** 64), "max_tokens"),
    (dict(top_k=2 ** 64), "top_k"), (dict(temperature=math.inf), "temperature"),
    (dict(temperature=10 ** 400), "temperature"), (dict(logprobs=True), "logprobs"),
    (dict(detokenize=None), "detokenize"), (dict(top_p="0.5"), "top_p"),
    (dict(stop_token_ids=[1, False]), "stop_token_ids"), (dict(min_p=None), "min_p"),
    (dict(n=True), "n"), (dict(n=0), "n"), (dict(n=129), "n"), (dict(n=2.0), "n"),
    (dict(stop=""), "stop"), (dict(stop=[""]), "stop"), (dict(stop=["a", 1]), "stop"),
    (dict(stop=b"ab"), "stop"), (dict(stop=["x"] * 65), "stop"), (dict(stop="x" * 1025), "stop"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=2.01), "repetition_penalty"),
    (dict(repetition_penalty=math.nan), "repetition_penalty"),
    (dict(presence_penalty=True), "presence_penalty"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(frequency_penalty=math.inf), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
])
def test_reported_bad_inputs(kwargs, field):
    raises_naming(f"SamplingParams.{field}", lambda: SamplingParams(**kwargs))


def test_stop_is_normalized_to_a_list():
    """vLLM's normalization: None -> [], a str -> [str]; the limits are inclusive."""
    assert SamplingParams().stop == [] and SamplingParams(stop=None).stop == []
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=[np.str_("x")]).stop == ["x"]
    assert type(SamplingParams(stop=[np.str_("x")]).stop[0]) is str
    assert SamplingParams(stop=["s" * 1024] * 64).stop == ["s" * 1024] * 64


def test_penalty_defaults_are_off():
    sp = SamplingParams()
    assert (sp.n, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty,
            sp.include_stop_str_in_output) == (1, 0.0, 0.0, 1.0, False)
    assert not sp.uses_penalties
    for kw in (dict(presence_penalty=-0.5), dict(frequency_penalty=2), dict(repetition_penalty=0.1)):
        assert SamplingParams(**kw).uses_penalties, kw


def test_tiny_temperature_is_greedy():
    for t in (0, 0.0, 1e-40, 5e-324, 9.99e-6):
        assert SamplingParams(temperature=t).is_greedy
    for t in (1e-5, 1e-3, 1.0):
        assert not SamplingParams(temperature=t).is_greedy


def test_numpy_numbers_are_converted():
    sp = SamplingParams(max_tokens=np.int32(5), temperature=np.float32(0.5), top_k=np.int64(3),
                        seed=np.uint64(7), ignore_eos=np.bool_(True),
                        stop_token_ids=np.array([1, 2]), logprobs=np.int8(2))
    check_good(sp)
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.seed, sp.ignore_eos, sp.stop_token_ids,
            sp.logprobs) == (5, 0.5, 3, 7, True, [1, 2], 2)


# ---- validate_request --------------------------------------------------------------------

@st.composite
def engine(draw) -> dict:
    block_size = draw(st.sampled_from([1, 4, 16]))
    max_model_len = draw(st.integers(2, 300))
    return dict(vocab_size=draw(st.integers(1, 1000)), max_model_len=max_model_len,
                block_size=block_size, num_kv_blocks=-(-max_model_len // block_size) + 2,
                num_lookahead=draw(st.integers(0, 2)))


@st.composite
def good_request(draw):
    eng = draw(engine())
    tok = st.integers(0, eng["vocab_size"] - 1)
    longest = min(40, eng["max_model_len"] - 1)
    ids = draw(st.one_of(st.lists(np_int(tok), min_size=1, max_size=longest),
                         st.lists(tok, min_size=1, max_size=longest)
                         .map(lambda xs: np.array(xs, np.int64)),
                         st.lists(tok, min_size=1, max_size=5).map(tuple)
                         .filter(lambda xs: len(xs) < eng["max_model_len"])))
    sp = SamplingParams(max_tokens=draw(st.integers(1, eng["max_model_len"])),
                        stop_token_ids=draw(st.lists(tok, max_size=3)),
                        temperature=draw(numbers(0.0, 2.0)),
                        seed=draw(st.none() | ints(I64_MIN, I64_MAX)))
    return ids, sp, eng


@FUZZ
@given(req=good_request())
def test_good_requests_pass_and_fit_the_wire(req):
    ids, sp, eng = req
    out = validate_request(3, ids, sp, **eng)
    assert type(out) is list and all(type(t) is int for t in out)
    assert out == [int(t) for t in ids]
    spec = RequestSpec(req_id="r", prompt_token_ids=out, sampling=sp)
    assert msgspec.msgpack.decode(encode(spec), type=RequestSpec) == spec


BAD_IDS = st.one_of(
    st.just([]).map(lambda v: (v, "empty")),
    int_list_junk.map(lambda v: (v, "prompt_token_ids")),
    st.lists(st.integers(0, 9), max_size=3).flatmap(
        lambda xs: st.one_of(st.integers(max_value=-1), st.integers(min_value=1000), huge_ints)
        .map(lambda b: ([*xs, b], "prompt_token_ids"))))


@FUZZ
@given(req=good_request(), data=st.data(),
       kind=st.sampled_from(["ids", "sp", "stop", "max_tokens", "too_long", "kv"]))
def test_bad_requests_are_named(req, data, kind):
    ids, sp, eng = req
    if kind == "ids":
        ids, field = data.draw(BAD_IDS)
    elif kind == "sp":
        sp, field = data.draw(st.one_of(junk, st.just({"max_tokens": 4}))), "sampling_params[3]"
    elif kind == "stop":
        sp.stop_token_ids = [*sp.stop_token_ids, data.draw(st.integers(eng["vocab_size"], I64_MAX))]
        field = "stop_token_ids"
    elif kind == "max_tokens":
        sp.max_tokens = data.draw(st.integers(eng["max_model_len"] + 1, I64_MAX))
        field = "max_tokens"
    elif kind == "too_long":
        ids, field = [0] * data.draw(st.integers(eng["max_model_len"], 400)), "max_model_len"
    else:
        eng["num_kv_blocks"] = -(-min(len(ids) + sp.max_tokens + eng["num_lookahead"],
                                      eng["max_model_len"]) // eng["block_size"]) - 1
        field = "num_kv_blocks"
    raises_naming(field, lambda: validate_request(3, ids, sp, **eng))


# ---- generate()'s arguments --------------------------------------------------------------

GOOD_PROMPTS = st.one_of(
    st.text(max_size=5), st.lists(st.integers(0, 9), max_size=4),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 9), max_size=4)},
                          optional={"prompt": st.none() | st.text(max_size=5)}),
    st.fixed_dictionaries({"prompt": st.text(max_size=5)}))
BAD_PROMPT = st.one_of(
    st.none(), st.integers(), st.floats(), st.booleans(), st.binary(max_size=3), st.just({1, 2}),
    st.just({}), st.just({"tokens": [1]}), st.just({"prompt": None}), st.just({"prompt": 5}),
    st.just({"prompt_token_ids": None}), st.just({"prompt_token_ids": "1 2"}),
    st.just({"prompt_token_ids": [1], "extra": 1}), st.just({"prompt": "x", "prompt_token_ids": 7}))


@FUZZ
@given(prompts=st.one_of(GOOD_PROMPTS.filter(lambda p: not isinstance(p, list)),
                         st.lists(GOOD_PROMPTS, max_size=4),
                         st.lists(GOOD_PROMPTS, max_size=4).map(tuple)))
def test_good_prompts_parse(prompts):
    for i, p in enumerate(as_prompt_list(prompts)):
        text, ids = parse_prompt(i, p)
        if isinstance(p, str):
            assert (text, ids) == (p, None)
        elif isinstance(p, list):
            assert (text, ids) == (None, p)
        else:
            assert (text, ids) == (p.get("prompt"), p.get("prompt_token_ids"))


def test_bare_token_list_is_a_list_of_prompts_and_refused():
    """`prompts` of ints is a list of (bad) prompts: one token-id prompt is [[...]] or a dict."""
    raises_naming("prompts[0]", lambda: parse_prompt(0, as_prompt_list([1, 2, 3])[0]))


@FUZZ
@given(good=st.lists(GOOD_PROMPTS, max_size=3), bad=BAD_PROMPT, at=st.integers(0, 3))
def test_bad_prompt_is_named(good, bad, at):
    at = min(at, len(good))
    prompts = good[:at] + [bad] + good[at:]

    def parse_all():
        for i, p in enumerate(as_prompt_list(prompts)):
            parse_prompt(i, p)
    raises_naming(f"prompts[{at}]", parse_all)


@pytest.mark.parametrize("prompts", [None, 5, 1.5, b"abc", {1, 2}, iter(["a"]), True])
def test_bad_prompts_argument_is_named(prompts):
    raises_naming("prompts", lambda: as_prompt_list(prompts))


@FUZZ
@given(n=st.integers(0, 4),
       bad=st.one_of(junk.filter(lambda v: v is not None and not isinstance(v, list)),
                     st.integers(), st.just({"max_tokens": 3})))
def test_sampling_params_argument(n, bad):
    sp = SamplingParams()
    assert as_params_list(None, n) == [SamplingParams()] * n
    assert as_params_list(sp, n) == [sp] * n
    assert as_params_list((sp,) * n, n) == [sp] * n
    raises_naming("sampling_params", lambda: as_params_list(bad, n))
    raises_naming("sampling_params", lambda: as_params_list([sp] * (n + 1), n))


def test_int_lists_plain_numpy_bool_and_range():
    """checks.as_int_list: plain ints pass as they are (the fast path), numpy ints become
    ints, bools and floats are refused by type, out-of-range values are named."""
    import numpy as np

    from ray_runtime.checks import InputTypeError, as_int_list

    assert as_int_list([3, 0, 9], "ids", 0, 9, "in [0, 9]") == [3, 0, 9]
    assert as_int_list((), "ids", 0, 9, "in [0, 9]") == []
    got = as_int_list([np.int64(4), 5], "ids", 0, 9, "in [0, 9]")
    assert got == [4, 5] and all(type(t) is int for t in got)
    assert as_int_list(np.array([1, 2]), "ids", 0, 9, "in [0, 9]") == [1, 2]
    for bad in ([1, True], [1, 2.0], np.array([1.0]), [None]):
        with pytest.raises(InputTypeError, match="ids must hold integers only"):
            as_int_list(bad, "ids", 0, 9, "in [0, 9]")
    with pytest.raises(ValueError, match=r"ids \[-1, 10\] outside in \[0, 9\]"):
        as_int_list([-1, 3, 10], "ids", 0, 9, "in [0, 9]")
