"""Random paged KV caches for the kernel tests: shuffled, non-contiguous blocks per request."""
import torch


def random_paged_kv(ctx_lens, *, num_kv_heads, head_dim, block_size, gen, table_dtype):
    """Block tables [requests, max blocks + 1] (two spare blocks in the pool) and key / value
    caches of random values for contexts of ctx_lens tokens."""
    per_req = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(per_req) + 2
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(ctx_lens), max(per_req) + 1, dtype=table_dtype)
    used = 0
    for i, n in enumerate(per_req):
        tables[i, :n] = order[used:used + n]
        used += n
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return tables, kc, vc
