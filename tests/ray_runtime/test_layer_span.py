"""ray_runtime/layer_span.py: partitions in whole and half layers become spans of blocks that
tile the model exactly once, each block on one stage; bad partitions are refused naming the
field."""
import pytest

from ray_runtime.layer_span import (HEAD_LAYERS, LayerSpan, StageBlocks, balanced_partition,
                                    block_cost, cheapest_prefill_spans, parse_partition,
                                    stage_blocks, stage_spans)


@pytest.mark.parametrize("num_layers,pp,partition", [
    (5, 2, None), (5, 3, None), (7, 4, None), (5, 4, None), (7, 3, None), (32, 4, None),
    (7, 3, "even"), (4, 4, None), (32, 2, (16.5, 15.5)), (32, 4, (8.5, 8, 8, 7.5)),
    (5, 3, (1.5, 2, 1.5)), (7, 3, (1, 4, 2)), (4, 2, (1, 3))])
def test_spans_tile_every_block_once(num_layers, pp, partition):
    spans = stage_spans(num_layers, pp, partition)
    assert spans[0].start == 0 and spans[-1].end == 2 * num_layers
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    for layer in range(num_layers):
        assert sum(s.has_attention(layer) for s in spans) == 1
        assert sum(s.has_mlp(layer) for s in spans) == 1
        # a layer's attention and KV cache live together
        assert [layer in s.attention_layers for s in spans] == [s.has_attention(layer) for s in spans]
    for s in spans:  # every stage runs at least one attention (it holds a KV cache)
        assert len(s.attention_layers) >= 1
        assert set(s.layers) == {i for i in range(num_layers) if s.has_attention(i) or s.has_mlp(i)}
    if isinstance(partition, tuple):
        assert [(s.end - s.start) / 2 for s in spans] == list(partition)


def test_even_split_puts_extra_layers_first():
    assert stage_spans(7, 3, "even") == [LayerSpan.of_layers(0, 3), LayerSpan.of_layers(3, 5),
                                         LayerSpan.of_layers(5, 7)]


def test_balanced_split_counts_the_head():
    assert balanced_partition(32, 2) == (16.5, 15.5)
    assert balanced_partition(32, 4) == (8, 8.5, 8.5, 7)
    assert balanced_partition(5, 2) == (3, 2) and balanced_partition(7, 4) == (2, 2, 2, 1)
    assert stage_spans(32, 2, None) == stage_spans(32, 2, "balanced") == \
        stage_spans(32, 2, (16.5, 15.5))


def _max_cost(partition) -> float:
    """The busiest stage's work in layers, the last stage's head counted as HEAD_LAYERS."""
    return max(list(partition[:-1]) + [partition[-1] + HEAD_LAYERS])


@pytest.mark.parametrize("num_layers", range(1, 41))
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_balanced_is_never_worse_than_even_and_within_half_a_layer_of_ideal(num_layers, pp):
    if pp > num_layers:
        return
    bal = balanced_partition(num_layers, pp)
    even = [(s.end - s.start) / 2 for s in stage_spans(num_layers, pp, "even")]
    assert sum(bal) == num_layers and min(bal) >= 1
    assert _max_cost(bal) <= _max_cost(even)
    ideal = (num_layers + HEAD_LAYERS) / pp
    assert _max_cost(bal) <= max(ideal + 0.5, 1 + HEAD_LAYERS), bal


def test_labels_and_bounds():
    a, b = stage_spans(32, 2, (16.5, 15.5))
    assert (a.label(), b.label()) == ("0-16a", "16m-31")
    assert (a.bounds, b.bounds) == ([0, 16.5], [16.5, 32])
    whole = LayerSpan.of_layers(3, 5)
    assert whole.label() == "3-4" and whole.bounds == [3, 5] and list(whole.layers) == [3, 4]


def test_parse_partition():
    assert parse_partition("16.5,15.5") == (16.5, 15.5)
    assert parse_partition("3,2,2") == (3, 2, 2) and all(type(x) is int for x in parse_partition("3,2"))
    assert parse_partition([2, 2.0]) == (2, 2) and parse_partition(None) is None
    assert parse_partition("even") == "even" and parse_partition(" balanced") == "balanced"
    with pytest.raises(ValueError, match="pp_layer_partition.*whole or half"):
        parse_partition("16.25,15.75")
    with pytest.raises(ValueError, match="pp_layer_partition must be 'balanced', 'even' or"):
        parse_partition("a,b")


@pytest.mark.parametrize("partition,match", [((2, 2), "sums to 4"), ((0.5, 4.5), ">= 1"),
                                             ((5,), "has 1 entries")])
def test_bad_partitions_name_the_field(partition, match):
    with pytest.raises(ValueError, match=f"pp_layer_partition.*{match}|{match}.*pp_layer_partition"):
        stage_spans(5, 2, partition)


@pytest.mark.parametrize("value", ["inf,1", "nan,4", (True, 4), (2.25, 2.75), "2,x"])
def test_non_numbers_and_quarter_layers_are_refused_even_unparsed(value):
    """stage_spans checks what an EngineConfig built directly (without parse_partition) holds:
    a quarter layer would otherwise leave a block on no stage."""
    with pytest.raises(ValueError, match="pp_layer_partition"):
        stage_spans(5, 2, value)


def test_names_and_arrays():
    import numpy as np

    assert stage_spans(5, 2, "EVEN") == stage_spans(5, 2, "even") == stage_spans(5, 2, np.array([3, 2]))
    assert stage_spans(5, 2, "2.5, 2.5") == [LayerSpan(0, 5), LayerSpan(5, 10)]


LLAMA8B_ATTENTION = 0.1923  # ModelSpec.attention_share of Llama-3-8B's shape


def _prefill_layers(blocks):
    return [(b.prefill.end - b.prefill.start) / 2 for b in blocks]


def test_the_prefill_split_moves_an_mlp_block_where_the_head_idles_the_last_stage():
    """Llama-3-8B at PP=4: decode's 8,8.5,8.5,7 leaves the last stage 7 layers of prefill work
    against 8.81 (layer 16's MLP on rank 2); layer 24's MLP moving on to the last stage gives
    8,8.5,8,7.5, the costliest stage 8.19. At PP=2 (16.5,15.5) and PP=3 nothing is cheaper."""
    blocks = stage_blocks(32, 4, None, None, LLAMA8B_ATTENTION)
    assert [b.decode for b in blocks] == stage_spans(32, 4, None)
    assert _prefill_layers(blocks) == [8, 8.5, 8, 7.5]
    assert blocks[3].prefill == LayerSpan(49, 64) and blocks[2].prefill == LayerSpan(33, 49)
    assert blocks[2].label() == "16m-24 (prefill 16m-24a)" and blocks[0].label() == "0-7"

    def cost(span):
        return sum(block_cost(x, LLAMA8B_ATTENTION) for x in range(span.start, span.end))
    assert round(max(cost(b.decode) for b in blocks), 2) == 8.81
    assert round(max(cost(b.prefill) for b in blocks), 2) == 8.19
    for pp in (1, 2, 3):
        assert all(b.prefill == b.decode for b in stage_blocks(32, pp, None, None, LLAMA8B_ATTENTION))
    assert all(b.prefill == b.decode for b in stage_blocks(32, 4, None, "same", LLAMA8B_ATTENTION))


@pytest.mark.parametrize("num_layers,pp,partition", [
    (32, 4, None), (32, 8, None), (7, 4, None), (5, 3, (1.5, 2, 1.5)), (4, 4, None), (9, 3, (4, 4, 1))])
def test_the_prefill_split_keeps_every_attention_where_its_cache_is(num_layers, pp, partition):
    for share in (0.05, LLAMA8B_ATTENTION, 0.5, 0.9):
        blocks = stage_blocks(num_layers, pp, partition, None, share)
        prefill = [b.prefill for b in blocks]
        assert prefill[0].start == 0 and prefill[-1].end == 2 * num_layers
        assert all(a.end == b.start for a, b in zip(prefill, prefill[1:]))
        for b in blocks:
            b.check()
            assert b.decode.attention_layers == b.prefill.attention_layers
            assert abs(b.decode.start - b.prefill.start) <= 1 and abs(b.decode.end - b.prefill.end) <= 1


def test_a_given_prefill_split_must_keep_each_stages_attention_layers():
    blocks = stage_blocks(5, 3, (2, 1.5, 1.5), (1.5, 2, 1.5), LLAMA8B_ATTENTION)
    assert _prefill_layers(blocks) == [1.5, 2, 1.5] and blocks[0].held == LayerSpan(0, 4)
    # 2.5,1,1.5 would move layer 2's attention (and its KV cache) to rank 0
    with pytest.raises(ValueError, match="pp_prefill_partition, stage 0: .*same attention layers"):
        stage_blocks(5, 3, (2, 1.5, 1.5), (2.5, 1, 1.5), LLAMA8B_ATTENTION)
    with pytest.raises(ValueError, match=r"pp_prefill_partition \[2, 1, 1\] sums to 4"):
        stage_blocks(5, 3, (2, 1.5, 1.5), (2, 1, 1), LLAMA8B_ATTENTION)
    with pytest.raises(ValueError, match="pp_prefill_partition has 2 entries"):
        stage_blocks(5, 1, None, "3,2", LLAMA8B_ATTENTION)  # checked at PP=1 too
    with pytest.raises(ValueError, match="pp_prefill_partition must be 'auto', 'same'"):
        stage_blocks(5, 3, None, "even", LLAMA8B_ATTENTION)
    with pytest.raises(ValueError, match="same attention layers"):
        StageBlocks(LayerSpan(0, 4), LayerSpan(0, 6)).check()


def test_the_prefill_search_equals_trying_every_choice():
    """cheapest_prefill_spans goes over the boundaries twice (linear in PP); trying each
    boundary's two choices in every combination finds the same least cost and moves."""
    import itertools
    import random

    def cost(spans, share):
        return max(round(sum(block_cost(x, share) for x in range(s.start, s.end)), 9) for s in spans)

    rng = random.Random(0)
    for _ in range(400):
        num_layers = rng.randint(2, 16)
        pp = rng.randint(2, min(num_layers, 7))
        cuts = sorted(rng.sample(range(1, 2 * num_layers), pp - 1))
        edges = [0, *cuts, 2 * num_layers]
        try:
            decode = stage_spans(num_layers, pp, tuple((b - a) / 2 for a, b in zip(edges, edges[1:])))
        except ValueError:
            continue  # a stage without an attention block
        share = rng.choice([0.05, LLAMA8B_ATTENTION, 0.5, 0.8])
        bounds = [s.end for s in decode[:-1]]
        best = None
        for choice in itertools.product(*[(b, b - 1 if b % 2 == 0 else b + 1) for b in bounds]):
            e = [0, *choice, 2 * num_layers]
            spans = [LayerSpan(a, b) for a, b in zip(e, e[1:])]
            key = (cost(spans, share), sum(c != b for c, b in zip(choice, bounds)))
            best = key if best is None or key < best else best
        got = cheapest_prefill_spans(decode, share)
        assert (cost(got, share), sum(g.end != d.end for g, d in zip(got, decode))) == best
    assert len(stage_blocks(64, 64, None, None, LLAMA8B_ATTENTION)) == 64  # at once, not 2^63
