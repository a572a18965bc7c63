"""The step's one staged copy: where each array lands in the buffer."""
from stages.staging import packed_offsets


def test_arrays_start_16_byte_aligned_and_never_overlap():
    sizes = [3, 0, 1, 8, 5, 2, 7]
    offsets, total = packed_offsets(sizes)
    assert all(o % 2 == 0 for o in offsets), offsets  # int64: even = 16 bytes
    spans = sorted((o, o + n) for o, n in zip(offsets, sizes) if n)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= total <= sum(sizes) + len(sizes)
