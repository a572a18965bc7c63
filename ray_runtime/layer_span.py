"""A stage's share of the decoder layers, and how a partition becomes those shares.

The unit is half a layer: block 2i is layer i's attention (its input norm, attention and
residual add), block 2i+1 its MLP (post-attention norm, MLP and residual add). Between the
two blocks the residual stream is one tensor, as it is between layers, so a stage boundary
may fall inside a layer: "16.5,15.5" gives rank 0 layers 0-15 and layer 16's attention (and
its KV cache), and the last rank layer 16's MLP onward.

The last rank also carries the final norm, the LM head and the sampler. The default split
("balanced") counts them as HEAD_LAYERS decoder layers and gives every stage the same share of
the whole, in halves; "even" gives every stage the same number of layers (vLLM's default).

That split is decode's: the head runs on every row of a decode step, but on only the last
token of each prompt in a prefill step, where it costs next to nothing and the last stage,
holding fewer layers, idles. An MLP block holds no KV cache, so a boundary may move by one
MLP block for a prefill-shaped step (StepPlan.prefill_shaped: fewer than half of its tokens
get logits) while every attention block stays where its cache is: both neighbours hold that
block's weights and the step's kind says which runs it. The prefill split ("auto", the
default) is the one whose costliest stage costs least, an attention block counted as its
share of a layer's weights (ModelSpec.attention_share) and the head as nothing; "same" keeps
decode's. Llama-3-8B at PP=4: decode 8,8.5,8.5,7; prefill 8,8.5,8,7.5 (layer 24's MLP moves
to the last stage), its costliest stage 8.19 layers of work against 8.81.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

# What the last stage's final norm, LM head and sampler cost, in decoder layers. Measured on
# a Llama-3-8B shape in decode on 2x H200 (docs/benchmarks.md): 16.5/15.5 leaves both stages
# idle 0.06-0.07, where 16/16 idles rank 0 0.12 and 17/15 the last rank 0.10.
HEAD_LAYERS = 1
NAMED = ("balanced", "even")
PREFILL_NAMED = ("auto", "same")
Partition = Union[str, tuple]


class LayerSpan(NamedTuple):
    start: int  # first block (2 x layer, + 1 for a layer's MLP)
    end: int  # one past the last block

    @classmethod
    def of_layers(cls, first: int, end: int) -> "LayerSpan":
        """Whole layers [first, end)."""
        return cls(2 * first, 2 * end)

    @property
    def layers(self) -> range:
        """The layers this stage holds a part of."""
        return range(self.start // 2, (self.end + 1) // 2)

    def has_attention(self, layer: int) -> bool:
        return self.start <= 2 * layer < self.end

    def has_mlp(self, layer: int) -> bool:
        return self.start <= 2 * layer + 1 < self.end

    @property
    def attention_layers(self) -> range:
        """The layers whose attention (and so KV cache) lives on this stage."""
        return range((self.start + 1) // 2, (self.end + 1) // 2)

    @property
    def bounds(self) -> list:
        """[first, end) in layers, a half as .5: [0, 16] for whole layers 0-15, [16.5, 32]."""
        return [_layers(self.start), _layers(self.end)]

    def label(self) -> str:
        """Inclusive, for names and logs: '0-15'; 'a' ends on a layer's attention ('0-16a'),
        'm' starts on a layer's MLP ('16m-31')."""
        first, last = self.start // 2, (self.end - 1) // 2
        return f"{first}{'m' if self.start % 2 else ''}-{last}{'a' if self.end % 2 else ''}"


def _layers(block: int):
    return block // 2 if block % 2 == 0 else block / 2


def parse_partition(value) -> Optional[Partition]:
    """'3,2,2', '16.5,15.5' or a sequence -> a tuple of layers per stage (int where whole);
    'balanced' or 'even' as they are; validated against the model in `stage_spans`."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str) and value.strip().lower() in NAMED:
        return value.strip().lower()
    bad = ValueError("pp_layer_partition must be 'balanced', 'even' or comma-separated numbers "
                     f"of layers (halves allowed, e.g. 16.5,15.5), got {value!r}")
    try:
        parts = value.split(",") if isinstance(value, str) else list(value)
    except TypeError:
        raise bad from None
    return tuple(_entry(x, bad) for x in parts)


def _entry(x, bad: ValueError):
    """One stage's layers: a finite whole or half number (int where whole)."""
    if isinstance(x, bool):
        raise bad
    try:
        n = float(x)
    except (TypeError, ValueError):
        raise bad from None
    if not math.isfinite(n) or n * 2 != int(n * 2):
        raise ValueError(f"pp_layer_partition entries must be whole or half layers, got {x!r}")
    return int(n) if n == int(n) else n


def _shares(total: int, parts: int) -> list[int]:
    """total split into parts as evenly as integers go, the extra ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def balanced_partition(num_layers: int, pp_size: int) -> tuple:
    """Layers per stage (halves allowed) that give every stage the same share of the decoder
    layers plus the last stage's HEAD_LAYERS; the last stage keeps at least one layer. The
    extra halves go to the stages just before the last, rank 0 last: it also embeds the ids
    and patches in the fed-back samples (on 4x H200, 8.5 layers cost rank 0 3.15 ms per step
    against rank 1's 3.08). 32 layers: 16.5,15.5 at PP=2; 8,8.5,8.5,7 at 4."""
    if pp_size == 1:
        return (num_layers,)
    head = 2 * HEAD_LAYERS
    last = max(2, _shares(2 * num_layers + head, pp_size)[-1] - head)
    halves = _shares(2 * num_layers - last, pp_size - 1)[::-1] + [last]
    return tuple(_layers(h) for h in halves)


def stage_spans(num_layers: int, pp_size: int, partition: Optional[Partition]) -> list[LayerSpan]:
    """Each stage's span: by `balanced_partition` (the default, None), the even split of
    whole layers ('even': the extra layers on the earliest stages), or layers per stage."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) exceeds the model's "
                         f"num_hidden_layers ({num_layers})")
    # parsed here too: an EngineConfig built directly skips parse_partition
    partition = parse_partition(partition)
    if partition is None or partition == "balanced":
        partition = balanced_partition(num_layers, pp_size)
    elif partition == "even":
        partition = tuple(_shares(num_layers, pp_size))
    if len(partition) != pp_size:
        raise ValueError(f"pp_layer_partition has {len(partition)} entries but "
                         f"pipeline_parallel_size is {pp_size}")
    if any(n < 1 for n in partition):  # two blocks in a row always hold an attention
        raise ValueError(f"pp_layer_partition entries must be >= 1, got {list(partition)}")
    if sum(partition) != num_layers:
        raise ValueError(f"pp_layer_partition {list(partition)} sums to {sum(partition)}, "
                         f"but the model has num_hidden_layers={num_layers}")
    spans, start = [], 0
    for n in partition:
        spans.append(LayerSpan(start, start + int(2 * n)))
        start += int(2 * n)
    return spans


class StageBlocks(NamedTuple):
    """What one stage runs: a decode-shaped step's blocks and a prefill-shaped step's (the
    same attention blocks; an MLP block at either end may differ)."""
    decode: LayerSpan
    prefill: LayerSpan

    @property
    def held(self) -> LayerSpan:
        """Every block whose weights the stage loads."""
        return LayerSpan(min(self.decode.start, self.prefill.start),
                         max(self.decode.end, self.prefill.end))

    def label(self) -> str:
        """decode's label, and prefill's where it differs: '16m-24', '16m-24 (prefill 16m-24a)'."""
        d = self.decode.label()
        return d if self.prefill == self.decode else f"{d} (prefill {self.prefill.label()})"

    def check(self) -> None:
        if self.decode.attention_layers != self.prefill.attention_layers:
            raise ValueError(f"a stage's prefill blocks {self.prefill.label()} must hold the same "
                             f"attention layers as its decode blocks {self.decode.label()} "
                             "(their KV cache is there): only an MLP block at a boundary may move")


def parse_prefill_partition(value) -> Optional[Partition]:
    """None or 'auto' -> None (the cheapest split); 'same'; or layers per stage."""
    if isinstance(value, str) and value.strip().lower() in PREFILL_NAMED:
        value = value.strip().lower()
        return None if value == "auto" else value
    if isinstance(value, str) and value.strip().lower() in NAMED:
        raise ValueError(f"pp_prefill_partition must be 'auto', 'same' or comma-separated numbers "
                         f"of layers, got {value!r}")
    return parse_partition(value)


def block_cost(block: int, attention_share: float) -> float:
    """A block's share of a layer's prefill work: its share of the layer's weights."""
    return attention_share if block % 2 == 0 else 1.0 - attention_share


def cheapest_prefill_spans(decode: list[LayerSpan], attention_share: float) -> list[LayerSpan]:
    """The prefill split from decode's: at each boundary between stages, the MLP block next to
    it stays or crosses (a whole-layer boundary hands the earlier stage's last MLP on; one
    after an attention block takes the next stage's first MLP back), whichever gives the
    costliest stage the least prefill work (fewest moves on a tie). Two passes over the
    boundaries, linear in PP: the least cost any choice reaches, then the fewest moves within it."""
    bounds = [s.end for s in decode[:-1]]
    # each boundary's options, the stay first: (edge, moved)
    options = [[(decode[0].start, 0)]] + [[(b, 0), (b - 1 if b % 2 == 0 else b + 1, 1)]
                                          for b in bounds] + [[(decode[-1].end, 0)]]

    def cost(a: int, b: int) -> float:
        return round(sum(block_cost(x, attention_share) for x in range(a, b)), 9)

    # pass 1: per option of boundary k, the least max cost of the stages before it
    least = [{0: 0.0}]
    for k in range(1, len(options)):
        least.append({j: min(max(least[-1][i], cost(options[k - 1][i][0], e))
                             for i in least[-1]) for j, (e, _) in enumerate(options[k])})
    ceiling = least[-1][0]
    # pass 2: the fewest moves with no stage above that, and the path
    moves = [{0: (0, None)}]
    for k in range(1, len(options)):
        step = {}
        for j, (e, moved) in enumerate(options[k]):
            ok = [(moves[-1][i][0] + moved, i) for i in moves[-1]
                  if cost(options[k - 1][i][0], e) <= ceiling]
            if ok:
                step[j] = min(ok)
        moves.append(step)
    j, edges = 0, []
    for k in range(len(options) - 1, -1, -1):
        edges.append(options[k][j][0])
        j = moves[k][j][1]
    edges.reverse()
    return [LayerSpan(a, b) for a, b in zip(edges, edges[1:])]


def stage_blocks(num_layers: int, pp_size: int, partition: Optional[Partition],
                 prefill_partition: Optional[Partition], attention_share: float) -> list[StageBlocks]:
    """Each stage's decode blocks (`stage_spans` of partition) and prefill blocks: the
    cheapest (prefill_partition None or 'auto'), decode's ('same'), or layers per stage that
    keep every stage's attention layers (a ValueError naming the stage otherwise)."""
    decode = stage_spans(num_layers, pp_size, partition)
    prefill_partition = parse_prefill_partition(prefill_partition)
    if prefill_partition == "same" or (pp_size == 1 and prefill_partition is None):
        prefill = decode
    elif prefill_partition is None:
        prefill = cheapest_prefill_spans(decode, attention_share)
    else:
        try:
            prefill = stage_spans(num_layers, pp_size, prefill_partition)
        except ValueError as e:  # its checks name the field they were written for
            raise ValueError(str(e).replace("pp_layer_partition", "pp_prefill_partition")) from None
    out = [StageBlocks(d, p) for d, p in zip(decode, prefill)]
    for rank, b in enumerate(out):
        try:
            b.check()
        except ValueError as e:
            raise ValueError(f"pp_prefill_partition, stage {rank}: {e}") from None
    return out
