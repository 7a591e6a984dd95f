"""KV pools (``runtime.engines.kv_pools``): rows join, grow into bigger pools, leave; columns past a row's length stay zero."""

from __future__ import annotations

import torch

from runtime.engines.kv_pools import KVPools

LAYERS, HEADS, DIM = 2, 2, 3


def _pools(max_len: int = 100) -> KVPools:
    return KVPools(LAYERS, HEADS, DIM, torch.float32, max_len, first_cap=4, growth=4)  # caps 4, 16, 64: rows cross them fast


def _prompt(pools: KVPools, owner: str, n: int, value: float) -> None:
    st = pools.staging(n)
    for i in range(LAYERS):
        st.k[i].fill_(value + i)
        st.v[i].fill_(-(value + i))
    st.filled = n
    pools.join(owner, st)


def _row(pools: KVPools, owner: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K and V of ``owner``: (heads, cap, dim)."""
    pool, row = pools.where[owner]
    return pool.k[0][row], pool.v[0][row]


def _write_next(pools: KVPools, owner: str, value: float) -> None:
    """What a decode step does for one row: write column ``length``, then advance its pool."""
    pool, row = pools.where[owner]
    n = pool.lengths[row]
    for i in range(LAYERS):
        pool.k[i][row, :, n] = value
        pool.v[i][row, :, n] = -value
    pool.lengths[row] += 1


def test_pool_caps_grow_by_the_factor_up_to_max_len() -> None:
    assert [p.cap for p in _pools(100).pools] == [4, 16, 64, 100]
    assert [p.cap for p in _pools(64).pools] == [4, 16, 64]
    # the default: caps double from 64, so a row past 64 tokens attends over less than twice its length
    assert [p.cap for p in KVPools(LAYERS, HEADS, DIM, torch.float32, 600).pools] == [64, 128, 256, 512, 600]


def test_join_picks_the_smallest_pool_with_room_for_one_more_token() -> None:
    pools = _pools()
    _prompt(pools, "a", 3, 1.0)
    _prompt(pools, "b", 4, 2.0)  # 4 tokens fill a cap-4 pool: it goes to the cap-16 pool
    assert pools.where["a"][0].cap == 4 and pools.where["b"][0].cap == 16
    k, v = _row(pools, "a")
    assert torch.equal(k[:, :3], torch.full((HEADS, 3, DIM), 1.0)) and torch.equal(v[:, :3], torch.full((HEADS, 3, DIM), -1.0))
    assert not k[:, 3:].any()
    assert torch.equal(pools.where["a"][0].k[1][0, :, :3], torch.full((HEADS, 3, DIM), 2.0))  # layer 1


def test_make_room_moves_a_full_row_with_its_contents() -> None:
    pools = _pools()
    _prompt(pools, "a", 3, 1.0)
    _prompt(pools, "b", 2, 5.0)
    _write_next(pools, "a", 9.0)  # a: 4 tokens, its pool (cap 4) is full
    pools.make_room("a")
    small, big = pools.pools[0], pools.pools[1]
    assert pools.where["a"] == (big, 0) and pools.where["b"] == (small, 0)  # b took a's old row
    k, _ = _row(pools, "a")
    assert k[:, :3].eq(1.0).all() and k[:, 3].eq(9.0).all() and not k[:, 4:].any()
    assert small.lengths == [2] and small.owners == ["b"]
    assert not small.k[0][1:].any(), "the moved row's old columns must be zeroed"
    pools.make_room("b")  # not full: stays
    assert pools.where["b"] == (small, 0)


def test_release_fills_the_hole_with_the_last_row_and_zeroes_what_it_leaves() -> None:
    pools = _pools()
    for i, owner in enumerate("abc"):
        _prompt(pools, owner, 3 - i, float(i + 1))  # a: 3 tokens of 1s, b: 2 of 2s, c: 1 of 3s
    pool = pools.where["a"][0]
    pools.release("a")
    assert pool.owners == ["c", "b"] and pool.lengths == [1, 2]
    assert pools.where["c"] == (pool, 0) and "a" not in pools.where
    k, v = _row(pools, "c")
    assert k[:, 0].eq(3.0).all() and not k[:, 1:].any() and not v[:, 1:].any(), "a's longer columns must not survive under c"
    assert not pool.k[0][2:].any() and not pool.v[1][2:].any()
    pools.release("b")
    pools.release("c")
    assert pool.rows == 0 and not pool.k[0].any() and pools.where == {}


def test_rows_grow_past_the_first_allocation() -> None:
    pools = _pools()
    for i in range(11):
        _prompt(pools, f"r{i}", 2, float(i))
    pool = pools.pools[0]
    assert pool.rows == 11 and pool.allocated >= 11
    for i in range(11):
        assert _row(pools, f"r{i}")[0][:, :2].eq(float(i)).all()
