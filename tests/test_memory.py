"""memory/: retention policies, KV caches, the memory bank, compressors and budget validation."""

import pytest
import torch

from arvdm.config import ConfigError, apply_overrides, get_preset
from arvdm.model.denoiser import Denoiser
from memory import (
    KVCache,
    MemoryBank,
    MemoryCompressor,
    RetentionError,
    RetentionPolicy,
    build_compressor,
    kept_indices,
)


def tiny_cfg(*overrides):
    base = ["model.image_size=16", "model.unet_channels=[8,16]", "model.patch_size=2", "model.dim=32", "model.depth=2",
            "model.heads=2",
            "model.num_actions=4", "diffusion.num_levels=100", "memory.length=4"]
    return apply_overrides(get_preset("tiny_time"), base + list(overrides))


# -- retention ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 11])
def test_retention_keeps_exactly_the_right_indices(n):
    assert kept_indices(RetentionPolicy("all"), n) == list(range(n))
    # last m: everything while fewer than m frames exist, then the newest m
    assert RetentionPolicy("last", length=4).kept_indices(n) == list(range(n))[-4:]
    sr = RetentionPolicy("sink_recent", length=6, sink=2, recent=3)
    expected = sorted(set(range(min(2, n))) | set(range(max(0, n - 3), n)))
    assert sr.kept_indices(n) == expected


def test_retention_hand_written_cases():
    sr = RetentionPolicy("sink_recent", sink=2, recent=3)
    assert sr.kept_indices(4) == [0, 1, 2, 3]  # fewer than s + r: nothing dropped
    assert sr.kept_indices(5) == [0, 1, 2, 3, 4]
    assert sr.kept_indices(6) == [0, 1, 3, 4, 5]
    assert sr.kept_indices(10) == [0, 1, 7, 8, 9]
    assert RetentionPolicy("last", length=3).kept_indices(10) == [7, 8, 9]
    assert RetentionPolicy("last", length=0).kept_indices(10) == []
    assert RetentionPolicy("sink_recent", sink=0, recent=2).kept_indices(5) == [3, 4]


@pytest.mark.parametrize("policy", [RetentionPolicy("last", length=3),
                                    RetentionPolicy("sink_recent", sink=1, recent=2)])
def test_retention_is_monotone(policy):
    # a dropped frame never comes back: what incremental eviction relies on
    for n in range(1, 20):
        assert set(policy.kept_indices(n + 1)) <= set(policy.kept_indices(n)) | {n}
        assert len(policy.kept_indices(n)) <= policy.capacity


def test_retention_rejects_bad_policies():
    with pytest.raises(RetentionError, match="unknown"):
        RetentionPolicy("everything")
    with pytest.raises(RetentionError, match="recent >= 1"):
        RetentionPolicy("sink_recent", sink=1, recent=0)
    with pytest.raises(RetentionError, match="committed"):
        RetentionPolicy("all").kept_indices(-1)


# -- KV cache -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tpf", [1, 3])
def test_kv_cache_append_evict_keeps_the_right_frames(tpf):
    cache = KVCache(RetentionPolicy("sink_recent", sink=1, recent=2), tokens_per_frame=tpf, initial_capacity=1)
    # frame f's keys are all f, values all -f: what survives eviction is readable off the tensors
    for start in range(0, 8, 2):
        k = torch.arange(start, start + 2).float().repeat_interleave(tpf)[None, None, :, None].expand(2, 1, 2 * tpf, 4)
        cache.append(k, -k, range(start, start + 2))
        cache.evict(start + 2)
    assert cache.frame_ids == [0, 6, 7]
    k, v = cache.keys_values()
    assert k.shape == (2, 1, 3 * tpf, 4)
    assert torch.equal(k[0, 0, :, 0], torch.tensor([0.0, 6.0, 7.0]).repeat_interleave(tpf))
    assert torch.equal(v, -k)
    assert cache.nbytes() == 2 * 2 * 1 * 3 * tpf * 4 * 4


def test_kv_cache_rejects_bad_appends():
    cache = KVCache(RetentionPolicy("all"))
    cache.append(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), [0, 1])
    with pytest.raises(ValueError, match="increase"):
        cache.append(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), [1])
    with pytest.raises(ValueError, match="tokens"):
        cache.append(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), [2, 3])
    with pytest.raises(ValueError, match="cache holds"):
        cache.append(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4), [2])


@pytest.mark.parametrize("form", ["factorized", "full"])
def test_rollout_cache_bytes_grow_with_all_and_stay_flat_with_sink_recent(form):
    sizes = {}
    for retention in ("all", "sink_recent"):
        model = Denoiser(tiny_cfg(f"memory.retention={retention}", "memory.sink=1", "memory.recent=2",
                                  f"model.temporal_attention={form}")).eval()
        state = model.init_state(1)
        sizes[retention] = []
        for _ in range(6):
            model.commit(state, torch.rand(1, 1, 3, 16, 16) * 2 - 1, torch.zeros(1, 1, dtype=torch.long))
            sizes[retention].append(state.nbytes())
        assert [len(c) for c in state.caches] == [6 if retention == "all" else 3] * 2
    per_frame = sizes["all"][0]
    assert sizes["all"] == [per_frame * i for i in range(1, 7)]  # linear growth
    assert sizes["sink_recent"] == [per_frame, 2 * per_frame] + [3 * per_frame] * 4  # flat at s + r


# -- memory bank --------------------------------------------------------------------------------------

def test_bank_keeps_the_frames_and_positions_of_its_policy():
    bank = MemoryBank(RetentionPolicy("sink_recent", sink=1, recent=2))
    assert bank.memory() is None
    frames = torch.arange(7.0)[None, :, None, None, None].expand(2, 7, 3, 4, 4)  # frame f is all f
    actions = torch.arange(7)[None].expand(2, 7)
    poses = torch.arange(7.0)[None, :, None].expand(2, 7, 3)
    for s in (0, 2, 3, 5):  # commits of 2, 1, 2, 2 frames
        e = {0: 2, 2: 3, 3: 5, 5: 7}[s]
        bank.append(frames[:, s:e], actions[:, s:e], poses[:, s:e])
    mem = bank.memory()
    assert bank.n_committed == 7 and len(bank) == 3
    assert mem.positions.tolist() == [0, 5, 6] and mem.window_start == 7
    assert mem.frames[0, :, 0, 0, 0].tolist() == [0.0, 5.0, 6.0]
    assert mem.actions[1].tolist() == [0, 5, 6] and mem.poses[0, :, 0].tolist() == [0.0, 5.0, 6.0]


def test_bank_rejects_mismatched_commits():
    bank = MemoryBank(RetentionPolicy("all"))
    bank.append(torch.zeros(1, 2, 3, 4, 4), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="actions"):
        bank.append(torch.zeros(1, 2, 3, 4, 4), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="do not match"):
        bank.append(torch.zeros(1, 2, 3, 8, 8), torch.zeros(1, 2, dtype=torch.long))


# -- compressors and budgets --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["joint", "modulated"])
def test_compressor_shapes_and_parameter_count_by_budget(kind):
    torch.manual_seed(0)
    n, d = 16, 32
    comps = {b: MemoryCompressor(kind, d, 2, n, b, num_actions=4) for b in (2, 4, 8)}
    counts = {b: sum(p.numel() for p in c.parameters()) for b, c in comps.items()}
    # only the learned query grids depend on the budget: B * N * D parameters
    assert counts[4] - counts[2] == 2 * n * d and counts[8] - counts[4] == 4 * n * d
    tokens, actions, ages = torch.randn(3, 8, n, d), torch.randint(0, 4, (3, 8)), torch.arange(8, 0, -1)
    for b, comp in comps.items():
        assert comp(tokens, actions, ages).shape == (3, b, n, d)
    assert comps[4](tokens[:, :3], actions[:, :3], ages[:3]).shape == (3, 4, n, d)  # a bank still filling up
    # actions reach the latents (joint: channel concat; modulated: FiLM)
    out = comps[4](tokens, actions, ages)
    assert not torch.allclose(out, comps[4](tokens, (actions + 1) % 4, ages), atol=1e-5)


def test_denoiser_parameter_count_scales_with_budget():
    counts = {b: Denoiser(tiny_cfg("memory.length=8", "memory.compressor=joint", f"memory.budget={b}",
                                   "memory.structure=channel_concat")).num_params() for b in (2, 4)}
    n, d = 16, 32
    # compressor queries (B*N*D) + channel-concat projection input (B*D*D)
    assert counts[4] - counts[2] == 2 * n * d + 2 * d * d
    assert build_compressor("none", dim=d, heads=2, num_tokens=n, budget=0, num_actions=4) is None


@pytest.mark.parametrize("overrides, match", [
    (["memory.compressor=joint", "memory.budget=5"], "memory.budget"),  # budget > m
    (["memory.compressor=joint", "memory.budget=0"], "memory.budget"),
    (["memory.budget=2"], "memory.budget"),  # a budget needs a compressor
    (["memory.structure=cross_attention", "memory.length=0"], "memory.length"),
    (["memory.structure=channel_concat", "memory.length=0"], "memory.length"),
    (["memory.structure=channel_concat", "memory.retention=all"], "retention"),
    (["memory.retention=sink_recent", "memory.sink=3", "memory.recent=3"], "sink/recent"),
    (["model.dim=30", "model.heads=2"], "even"),
])
def test_invalid_memory_configs_raise_clear_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        Denoiser(tiny_cfg(*overrides))
