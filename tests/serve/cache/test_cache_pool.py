"""The page pool's typed KDA access: exact round trips that touch only the KDA bytes of the pages asked for."""

import pytest
import torch

from k3.config import K3Config
from k3.serve.cache.pool import CachePool


@pytest.mark.parametrize("kda_heads", [2, 1], ids=["kda-pages-larger", "mla-pages-larger"])
def test_kda_state_round_trip_touches_only_those_pages_kda_bytes(kda_heads):
    cfg = K3Config.from_preset("tiny").replace(kda_num_heads=kda_heads, kda_head_dim=16 if kda_heads == 1 else 64)
    pool = CachePool(cfg, 7, 48)
    assert (pool.kda_page_bytes > pool.mla_page_bytes) == (kda_heads == 2)
    g = torch.Generator().manual_seed(0)
    pool.pages.copy_(torch.randint(0, 256, pool.pages.shape, generator=g, dtype=torch.uint8))
    before = pool.pages.clone()
    ids = torch.tensor([5, 2])
    state = torch.randn(2, *pool.kda_state_shape, generator=g)
    conv = torch.randn(2, *pool.kda_conv_shape, generator=g)
    pool.write_kda(ids, state, conv)
    s2, c2 = pool.read_kda(ids)
    assert torch.equal(s2, state) and torch.equal(c2, conv)
    assert s2.dtype == c2.dtype == torch.float32
    changed = (pool.pages != before).any(1).nonzero().flatten().tolist()
    assert changed == [2, 5]
    assert torch.equal(pool.pages[:, pool.kda_page_bytes:], before[:, pool.kda_page_bytes:])
    pool.write_kda(torch.tensor([], dtype=torch.long), state[:0], conv[:0])  # nothing to write
    assert torch.equal(pool.read_kda(torch.tensor([2]))[0][0], state[1])
