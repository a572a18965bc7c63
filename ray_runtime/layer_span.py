"""A stage's share of the decoder layers, and how a partition becomes those shares.

The unit is half a layer: block 2i is layer i's attention (its input norm, attention and
residual add), block 2i+1 its MLP (post-attention norm, MLP and residual add). Between the
two blocks the residual stream is one tensor, as it is between layers, so a stage boundary
may fall inside a layer: "16.5,15.5" gives rank 0 layers 0-15 and layer 16's attention (and
its KV cache), and the last rank layer 16's MLP onward. The last rank also carries the final
norm, the LM head and the sampler; half a layer is the finer step that balances them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence


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


def parse_partition(value) -> Optional[tuple]:
    """'3,2,2', '16.5,15.5' or a sequence -> a tuple of layers per stage (int where whole);
    validated against the model in `stage_spans`."""
    if value is None or value == "":
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for x in parts:
        try:
            n = float(x)
        except (TypeError, ValueError):
            raise ValueError("pp_layer_partition must be comma-separated numbers of layers "
                             f"(halves allowed, e.g. 16.5,15.5), got {value!r}") from None
        if n * 2 != int(n * 2):
            raise ValueError(f"pp_layer_partition entries must be whole or half layers, got {x!r}")
        out.append(int(n) if n == int(n) else n)
    return tuple(out)


def stage_spans(num_layers: int, pp_size: int, partition: Optional[Sequence]) -> list[LayerSpan]:
    """Each stage's span. The even split puts the extra layers on the earliest stages, since
    the last stage also carries the LM head and the sampler."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) exceeds the model's "
                         f"num_hidden_layers ({num_layers})")
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        partition = tuple(base + (1 if r < extra else 0) for r in range(pp_size))
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
