"""KVCache with a moving start: same contents as a plain list of frames under every policy, views without
copies of the past, and a sliding window that neither reallocates nor grows once it is full."""

from __future__ import annotations

import random

import pytest
import torch

from memory import KVCache, RetentionPolicy

POLICIES = [RetentionPolicy("all"), RetentionPolicy("last", length=5), RetentionPolicy("sink_recent", sink=2, recent=3)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.kind)
@pytest.mark.parametrize("tpf", [1, 3])
def test_cache_matches_a_list_of_frames(policy, tpf):
    rng = random.Random(0)
    cache = KVCache(policy, tokens_per_frame=tpf, initial_capacity=2)
    ref: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # frame id -> (k, v) of that frame
    n_committed = 0
    for _ in range(40):
        n = rng.choice([1, 1, 2, 3])
        k, v = torch.randn(2, 2, n * tpf, 4), torch.randn(2, 2, n * tpf, 4)
        cache.append(k, v, range(n_committed, n_committed + n))
        for j in range(n):
            ref[n_committed + j] = (k[:, :, j * tpf:(j + 1) * tpf], v[:, :, j * tpf:(j + 1) * tpf])
        n_committed += n
        cache.evict(n_committed)
        kept = policy.kept_indices(n_committed)
        assert cache.frame_ids == kept
        want_k = torch.cat([ref[i][0] for i in kept], dim=2)
        want_v = torch.cat([ref[i][1] for i in kept], dim=2)
        got_k, got_v = cache.keys_values()
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        # the window's K/V appended without a copy of the past: equal to the concatenation
        wk, wv = torch.randn(2, 2, 2 * tpf, 4), torch.randn(2, 2, 2 * tpf, 4)
        ek, ev = cache.keys_values_with(wk, wv)
        assert torch.equal(ek, torch.cat([want_k, wk], 2)) and torch.equal(ev, torch.cat([want_v, wv], 2))
        # ... and it did not commit anything
        assert cache.frame_ids == kept and torch.equal(cache.keys_values()[0], want_k)


def test_sliding_window_reuses_its_buffer_and_views_share_it():
    cache = KVCache(RetentionPolicy("last", length=16), initial_capacity=4)
    ptrs, caps = set(), set()
    for f in range(200):
        cache.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), [f])
        cache.evict(f + 1)
        if f >= 64:
            ptrs.add(cache._k.data_ptr())
            caps.add(cache.capacity_nbytes())
    assert len(ptrs) == 1 and len(caps) == 1  # no reallocation once the window is full
    assert cache.capacity_nbytes() <= 2 * cache.nbytes()  # slack of at most the window itself
    k, _ = cache.keys_values_with(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    assert k.data_ptr() >= cache._k.data_ptr() and k.shape[2] == 17  # a view into the buffer, not a copy


@pytest.mark.parametrize("tpf", [1, 3])
def test_shrink_to_fit_keeps_the_frames_and_releases_the_long_buffer(tpf):
    """A cache whose policy became bounded (a hybrid layer converted to streaming) gives back its long buffer."""
    cache = KVCache(RetentionPolicy("all"), tokens_per_frame=tpf, initial_capacity=2)
    k, v = torch.randn(2, 2, 64 * tpf, 4), torch.randn(2, 2, 64 * tpf, 4)
    cache.append(k, v, range(64))
    long_bytes = cache.capacity_nbytes()
    cache.policy = RetentionPolicy("sink_recent", sink=2, recent=3)
    cache.evict(64)
    assert cache.capacity_nbytes() == long_bytes  # evicting alone keeps the 64-frame buffer alive
    want_k, want_v = (t.clone() for t in cache.keys_values())
    cache.shrink_to_fit()
    assert cache.frame_ids == [0, 1, 61, 62, 63]
    assert cache.capacity_nbytes() == cache.nbytes() == long_bytes * 5 // 64
    assert cache._k.untyped_storage().nbytes() == cache.nbytes() // 2  # a new storage, not a view of the old one
    got_k, got_v = cache.keys_values()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    for f in range(64, 100):  # and it still works as a cache, with a small buffer
        cache.append(torch.full((2, 2, tpf, 4), float(f)), torch.full((2, 2, tpf, 4), -float(f)), [f])
        cache.evict(f + 1)
    assert cache.frame_ids == [0, 1, 97, 98, 99]
    assert torch.equal(cache.keys_values()[0][:, :, :2 * tpf], want_k[:, :, :2 * tpf])  # the sinks
    assert torch.equal(cache.keys_values()[0][:, :, 2 * tpf:], torch.tensor([97.0, 98, 99]).repeat_interleave(tpf)
                       .view(1, 1, -1, 1).expand(2, 2, -1, 4))
    assert cache.capacity_nbytes() <= 4 * cache.nbytes()
    cache.policy = RetentionPolicy("last", length=0)
    cache.evict(100)
    cache.shrink_to_fit()
    assert cache.capacity_nbytes() == 0 and cache.keys_values() is None  # empty: the buffer is released
    cache.append(k[:, :, :tpf], v[:, :, :tpf], [100])
    assert cache.frame_ids == [100]
