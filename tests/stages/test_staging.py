"""The step's one staged copy: where each array lands in the buffer."""
from stages.staging import packed_offsets


def test_arrays_start_16_byte_aligned_and_never_overlap():
    sizes = [3, 0, 1, 8, 5, 2, 7]
    offsets, total = packed_offsets(sizes)
    assert all(o % 2 == 0 for o in offsets), offsets  # int64: even = 16 bytes
    spans = sorted((o, o + n) for o, n in zip(offsets, sizes) if n)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= total <= sum(sizes) + len(sizes)


def test_packed_arrays_read_back_with_their_shapes():
    """The packing and the views the step reads, as the CUDA path does them (the device copy
    replaced by the host buffer itself)."""
    import numpy as np
    import torch

    from stages.staging import pack, unpack

    rng = np.random.default_rng(0)
    arrays = [rng.integers(-5, 99, size=s).astype(np.int64)
              for s in [(3,), (0,), (2, 5), (1,), (7,), (4, 3)]]
    offsets, total = packed_offsets([a.size for a in arrays])
    host = np.full(total, -1, np.int64)
    pack(arrays, offsets, host)
    views = unpack(torch.from_numpy(host), arrays, offsets)
    for a, v in zip(arrays, views):
        assert v.shape == a.shape and (v.numpy() == a).all()
