"""kernels/paged_attention.py: the KV write and the paged attention reference, against a
dense attention written here from scratch.

Each request's whole context K/V is scattered into a NaN-initialised paged cache through
a shuffled, non-contiguous block table (padded with ids of other requests' blocks), so
reading a wrong slot, an unwritten slot or a padding entry shows up as a NaN or a mismatch.
"""
from __future__ import annotations

import math

import pytest
import torch

from kernels.paged_attention import paged_attention, paged_attention_ref, write_kv_ref

NUM_KV_HEADS = 2
ATOL = 1e-5


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     group: int) -> torch.Tensor:
    """q: [q_len, heads, d] at the last q_len positions of a context of k.shape[0] tokens;
    k, v: [ctx, kv_heads, d]. Plain softmax(QK^T/sqrt(d) + causal mask)V, in float64."""
    q_len, num_heads, d = q.shape
    ctx = k.shape[0]
    kv_of_head = torch.arange(num_heads) // group  # GQA: head h reads kv head h // group
    k = k.double()[:, kv_of_head]  # [ctx, heads, d]
    v = v.double()[:, kv_of_head]
    q = q.double()
    # Query j sits at position ctx - q_len + j and sees keys 0..that position.
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    mask = torch.zeros(q_len, ctx, dtype=torch.float64).masked_fill(k_pos > q_pos, float("-inf"))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d) + mask
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out.float()


@pytest.fixture(params=["ref", "dispatch"], autouse=True)
def attention_impl(request, monkeypatch):
    """Every case runs on the per-request reference and on the batched-decode dispatcher."""
    global _ATTENTION
    _ATTENTION = paged_attention_ref if request.param == "ref" else paged_attention
    yield request.param


_ATTENTION = paged_attention_ref


def _run_case(reqs: list[tuple[int, int]], *, group: int, head_dim: int, block_size: int,
              seed: int = 0) -> None:
    """reqs: (context length, query length) per request, laid out in this order."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    blocks_per_req = [-(-ctx // block_size) for ctx, _ in reqs]
    spare = 3
    num_blocks = sum(blocks_per_req) + spare
    # Shuffled pool: each request gets random, non-contiguous blocks.
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_req) + 2
    block_tables = torch.empty(len(reqs), max_blocks, dtype=torch.long)
    owned: list[list[int]] = []
    for i, n in enumerate(blocks_per_req):
        mine, pool = pool[:n], pool[n:]
        owned.append(mine)
    all_ids = [b for o in owned for b in o]
    for i, mine in enumerate(owned):
        # Padding past the request's blocks holds other requests' (valid) block ids.
        others = [b for b in all_ids if b not in mine] or mine
        pad = [others[(i + j) % len(others)] for j in range(max_blocks - len(mine))]
        block_tables[i] = torch.tensor(mine + pad)

    key_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, head_dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    ks = [torch.randn(ctx, NUM_KV_HEADS, head_dim, generator=gen) for ctx, _ in reqs]
    vs = [torch.randn(ctx, NUM_KV_HEADS, head_dim, generator=gen) for ctx, _ in reqs]

    def slots(i: int, positions: torch.Tensor) -> torch.Tensor:
        return block_tables[i, positions // block_size] * block_size + positions % block_size

    # Earlier steps: the cached prefixes, written request by request.
    for i, (ctx, q_len) in enumerate(reqs):
        if ctx > q_len:
            pos = torch.arange(ctx - q_len)
            write_kv_ref(key_cache, value_cache, ks[i][pos], vs[i][pos], slots(i, pos))
    # This step: every request's new tokens in one write, in the step's layout.
    step_k, step_v, step_slots = [], [], []
    for i, (ctx, q_len) in enumerate(reqs):
        pos = torch.arange(ctx - q_len, ctx)
        step_k.append(ks[i][pos])
        step_v.append(vs[i][pos])
        step_slots.append(slots(i, pos))
    write_kv_ref(key_cache, value_cache, torch.cat(step_k), torch.cat(step_v),
                 torch.cat(step_slots))

    # The write itself: every slot of every request holds its K/V.
    for i, (ctx, _) in enumerate(reqs):
        s = slots(i, torch.arange(ctx))
        torch.testing.assert_close(key_cache.view(-1, NUM_KV_HEADS, head_dim)[s], ks[i],
                                   rtol=0, atol=0)
        torch.testing.assert_close(value_cache.view(-1, NUM_KV_HEADS, head_dim)[s], vs[i],
                                   rtol=0, atol=0)

    q_lens = [q for _, q in reqs]
    query_start_loc = [0]
    for q in q_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    query = torch.randn(query_start_loc[-1], num_heads, head_dim, generator=gen)
    seq_lens = [ctx for ctx, _ in reqs]

    out = _ATTENTION(query, key_cache, value_cache, block_tables, seq_lens,
                     query_start_loc, 1.0 / math.sqrt(head_dim))
    assert out.shape == query.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any()
    for i, (ctx, q_len) in enumerate(reqs):
        a, b = query_start_loc[i], query_start_loc[i + 1]
        expected = _dense_attention(query[a:b], ks[i], vs[i], group)
        torch.testing.assert_close(out[a:b], expected, rtol=0, atol=ATOL,
                                   msg=lambda m: f"request {i} (ctx={ctx}, q_len={q_len}): {m}")


# A mixed batch: prefill chunks over a cached prefix, decode rows, a whole prompt from 0.
MIXED = [
    (37, 11),  # prefill chunk attending to a 26-token cached prefix
    (20, 1),   # decode
    (13, 13),  # whole prompt from position 0
    (50, 1),   # decode
    (29, 5),   # another chunk
    (2, 1),    # decode right after a one-token prompt
]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch_matches_dense(group, head_dim, block_size):
    _run_case(MIXED, group=group, head_dim=head_dim, block_size=block_size,
              seed=100 * group + head_dim + block_size)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_all_decode_rows(group, block_size):
    _run_case([(9, 1), (1, 1), (40, 1), (21, 1), (33, 1)], group=group, head_dim=16,
              block_size=block_size, seed=8)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_rows_first(group, block_size):
    _run_case([(9, 1), (1, 1), (40, 1), (21, 21), (33, 16)], group=group, head_dim=16,
              block_size=block_size, seed=7)


EDGE_CASES = {
    # One token in the whole batch: a one-token prompt, and a lone decode row.
    "single_token_prompt": lambda bs: [(1, 1)],
    "single_decode_row": lambda bs: [(2 * bs + 3, 1)],
    # A chunk that ends exactly on a block edge, with a cached prefix before it.
    "chunk_ends_on_block_edge": lambda bs: [(3 * bs, bs + 1 if bs > 1 else 2), (bs, 1)],
    "chunk_is_whole_blocks": lambda bs: [(4 * bs, 2 * bs), (2 * bs + 1, 1)],
    # A context of exactly one block: as a whole prompt, as a decode, as a chunk.
    "context_one_block_prompt": lambda bs: [(bs, bs)],
    "context_one_block_decode": lambda bs: [(bs, 1), (bs, bs)],
    # Speculative verification: 1 + k tokens per request as decode rows (each its own causal
    # context), beside a decode and a chunk just past SHORT_CHUNK that runs on its own.
    "verification_rows": lambda bs: [(30, 5), (12, 4), (7, 1), (45, 17), (16, 16)],
    # No decode rows at all: only prefill chunks and whole prompts.
    "no_decode_rows": lambda bs: [(17, 17), (30, 6), (2 * bs, bs), (5, 5)],
}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_edge_cases(case, group, block_size):
    _run_case(EDGE_CASES[case](block_size), group=group, head_dim=16, block_size=block_size,
              seed=3)


def test_chunked_prefill_equals_whole_prompt():
    """Attending chunk by chunk through the cache gives the same rows as one whole-prompt
    pass: the cached prefix is read back exactly as written."""
    gen = torch.Generator().manual_seed(11)
    bs, group, d, ctx = 4, 2, 16, 23
    num_heads = NUM_KV_HEADS * group
    num_blocks = 10
    table = torch.tensor([[7, 2, 9, 0, 5, 3, 1, 8]])
    k = torch.randn(ctx, NUM_KV_HEADS, d, generator=gen)
    v = torch.randn(ctx, NUM_KV_HEADS, d, generator=gen)
    q = torch.randn(ctx, num_heads, d, generator=gen)
    pos = torch.arange(ctx)
    slot = table[0, pos // bs] * bs + pos % bs
    scale = 1.0 / math.sqrt(d)

    kc = torch.full((num_blocks, bs, NUM_KV_HEADS, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    write_kv_ref(kc, vc, k, v, slot)
    whole = paged_attention_ref(q, kc, vc, table, [ctx], [0, ctx], scale)

    kc2 = torch.full_like(kc, float("nan"))
    vc2 = torch.full_like(kc, float("nan"))
    chunks, start = [], 0
    for size in (5, 3, 8, 1, 6):  # 5+3+8+1+6 = 23; 8 and 16 are block edges
        end = start + size
        write_kv_ref(kc2, vc2, k[start:end], v[start:end], slot[start:end])
        chunks.append(paged_attention_ref(q[start:end], kc2, vc2, table, [end], [0, size],
                                          scale))
        start = end
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=0, atol=ATOL)
    torch.testing.assert_close(whole, _dense_attention(q, k, v, group), rtol=0, atol=ATOL)


def test_write_kv_touches_only_its_slots():
    gen = torch.Generator().manual_seed(5)
    kc = torch.zeros(6, 4, NUM_KV_HEADS, 8)
    vc = torch.zeros_like(kc)
    slot = torch.tensor([13, 2, 22, 7])
    key = torch.randn(4, NUM_KV_HEADS, 8, generator=gen)
    val = torch.randn(4, NUM_KV_HEADS, 8, generator=gen)
    write_kv_ref(kc, vc, key, val, slot)
    flat_k, flat_v = kc.view(-1, NUM_KV_HEADS, 8), vc.view(-1, NUM_KV_HEADS, 8)
    assert torch.equal(flat_k[slot], key) and torch.equal(flat_v[slot], val)
    assert torch.equal(kc[13 // 4, 13 % 4], key[0])  # slot = block * block_size + offset
    others = torch.ones(flat_k.shape[0], dtype=torch.bool)
    others[slot] = False
    assert not flat_k[others].any() and not flat_v[others].any()
