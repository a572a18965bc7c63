"""The Triton decode-attention kernel against the torch reference, on CPU through Triton's
interpreter (TRITON_INTERPRET=1); the GPU run of the same comparison is bench/gpu_check.py."""
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.decode_attention_triton import paged_decode_attention  # noqa: E402
from kernels.paged_attention import paged_attention_ref  # noqa: E402
from tests.kernels.paged_kv import random_paged_kv  # noqa: E402


def _case(ctx_lens, *, group, head_dim, block_size, num_kv_heads=2, seed=0, num_splits=None):
    gen = torch.Generator().manual_seed(seed)
    tables, kc, vc = random_paged_kv(ctx_lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     block_size=block_size, gen=gen, table_dtype=torch.int32)
    q = torch.randn(len(ctx_lens), num_kv_heads * group, head_dim, generator=gen)
    scale = 1.0 / math.sqrt(head_dim)
    ours = paged_decode_attention(q, kc, vc, tables, torch.tensor(ctx_lens, dtype=torch.int32), scale,
                                  num_splits=num_splits)
    ref = paged_attention_ref(q, kc, vc, tables.long(), list(ctx_lens),
                              list(range(len(ctx_lens) + 1)), scale)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("group", [1, 2, 4, 3])
@pytest.mark.parametrize("head_dim,block_size", [(16, 4), (64, 16), (128, 16)])
def test_matches_reference(group, head_dim, block_size):
    _case([1, block_size, block_size + 1, 3 * block_size, 37], group=group, head_dim=head_dim,
          block_size=block_size, seed=group * head_dim)


def test_single_row_single_token():
    _case([1], group=2, head_dim=16, block_size=16)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_context_merges_to_the_reference(num_splits):
    """Flash-decoding splits: contexts shorter than one tile leave later splits empty; a
    split count that does not divide the tiles gives uneven splits."""
    _case([1, 63, 64, 65, 200, 300], group=4, head_dim=32, block_size=16, num_splits=num_splits,
          seed=num_splits)


def test_default_splits_follow_rows_and_context():
    from kernels.decode_attention_triton import default_num_splits

    cpu = torch.device("cpu")  # 8 pretend SMs off CUDA
    assert default_num_splits(1, 1, 4096, cpu) == 16
    assert default_num_splits(1, 1, 100, cpu) == 2  # never more splits than 64-token tiles
    assert default_num_splits(256, 8, 4096, cpu) == 1


def test_shape_validation():
    q = torch.zeros(2, 4, 16)
    kc = torch.zeros(3, 4, 3, 16)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q, kc, kc, torch.zeros(2, 2, dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(torch.zeros(2, 4, 16), torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16),
                               torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                               0.25, num_splits=0)
    with pytest.raises(ValueError, match="power of two"):
        kc5 = torch.zeros(3, 5, 2, 16)
        paged_decode_attention(q, kc5, kc5, torch.zeros(2, 2, dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32), 0.25)
