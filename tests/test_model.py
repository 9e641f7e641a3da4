"""arvdm/model/denoiser.py: the denoiser's shapes, chunked causality, memory structures, caches, checkpoints."""

import json
import math

import pytest
import torch

from arvdm.config import apply_overrides, get_preset
from arvdm.model import CheckpointError, Denoiser, DenoiserError
from memory import MemoryFrames

B, C, S, A = 2, 3, 16, 4  # batch, channels, image size, actions
STRUCTURES = ["prepend", "channel_concat", "cross_attention"]


DIT = ["model.unet_channels=[]", "model.patch_size=4"]  # the plain patch DiT (no conv levels)


def tiny_cfg(*overrides):
    # a small conv U-Net: 8 channels at 16 px, 16 at 8 px, then 2x2 patches -> 4x4 tokens per frame
    base = ["model.image_size=16", "model.unet_channels=[8,16]", "model.patch_size=2", "model.dim=32",
            "model.depth=2", "model.heads=2",
            f"model.num_actions={A}", "diffusion.num_levels=100", "memory.length=4"]
    return apply_overrides(get_preset("tiny_time"), base + list(overrides))


def make(*overrides, seed=0, perturb=True):
    """A tiny model; `perturb` lifts the zero-inits (AdaLN-Zero, output head) so every path is live."""
    torch.manual_seed(seed)
    model = Denoiser(tiny_cfg(*overrides)).eval()
    if perturb:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def frames(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, t, C, S, S, generator=g) * 2 - 1


def acts(t, seed=0):
    return torch.randint(0, A, (B, t), generator=torch.Generator().manual_seed(seed))


def lv(t, seed=0):
    return torch.randint(0, 101, (B, t), generator=torch.Generator().manual_seed(seed))


# -- shapes, init, causality --------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["factorized", "full"])
@pytest.mark.parametrize("backbone", [[], DIT], ids=["unet", "dit"])
def test_forward_shape_zero_init_and_nonzero_after_one_step(form, backbone):
    model = make(f"model.temporal_attention={form}", *backbone, perturb=False).train()
    x = frames(4)
    v = model(x, lv(4), acts(4))
    assert v.shape == x.shape
    assert torch.count_nonzero(v) == 0  # zero-initialised head: training starts from v = 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = (model(x, lv(4), acts(4)) - x).pow(2).mean()
    loss.backward()
    opt.step()
    assert model(x, lv(4), acts(4)).abs().mean() > 1e-4


@pytest.mark.parametrize("form", ["factorized", "full"])
@pytest.mark.parametrize("backbone", [[], DIT], ids=["unet", "dit"])
def test_chunked_causality(form, backbone):
    model = make(f"model.temporal_attention={form}", "model.frames_per_chunk=2", *backbone)
    x, levels, a = frames(6), lv(6), acts(6)
    with torch.no_grad():
        base = model(x, levels, a)
        later = x.clone()
        later[:, 4] = -later[:, 4]  # frame 4 is in chunk 2
        out = model(later, levels, a)
        assert torch.equal(out[:, :4], base[:, :4])  # earlier chunks never see a later chunk
        assert not torch.allclose(out[:, 4:], base[:, 4:])
        inside = x.clone()
        inside[:, 3] = -inside[:, 3]  # frame 3 shares chunk 1 with frame 2
        out = model(inside, levels, a)
        assert torch.equal(out[:, :2], base[:, :2])
        assert (out[:, 2] - base[:, 2]).abs().max() > 1e-4  # frames inside one chunk see each other
        a2 = a.clone()
        a2[:, 5] = (a2[:, 5] + 1) % A  # an action is part of its frame's condition
        out = model(x, levels, a2)
        assert torch.equal(out[:, :4], base[:, :4]) and not torch.allclose(out[:, 4:], base[:, 4:])


def test_factorized_and_full_differ_and_rope_is_relative():
    fac, full = make("model.temporal_attention=factorized"), make("model.temporal_attention=full")
    x, levels, a = frames(4), lv(4), acts(4)
    mem = MemoryFrames(frames(4, seed=1), acts(4, seed=1))
    with torch.no_grad():
        assert not torch.allclose(fac(x, levels, a, memory=mem), full(x, levels, a, memory=mem), atol=1e-4)
        # temporal RoPE: shifting every absolute position (memory and window) changes nothing
        far = MemoryFrames(mem.frames, mem.actions, positions=torch.arange(4) + 100)
        torch.testing.assert_close(full(x, levels, a, memory=far), full(x, levels, a, memory=mem),
                                   atol=1e-4, rtol=0)


def test_prepend_memory_is_a_level_zero_prefix():
    model = make("memory.structure=prepend", "model.frames_per_chunk=2")
    m, w = frames(4, seed=1), frames(4)
    ma, wa, levels = acts(4, seed=1), acts(4), lv(4)
    with torch.no_grad():
        with_memory = model(w, levels, wa, memory=MemoryFrames(m, ma))
        # the same frames as one plain window, memory frames at level 0
        plain = model(torch.cat([m, w], 1), torch.cat([torch.zeros_like(levels), levels], 1),
                      torch.cat([ma, wa], 1))
    torch.testing.assert_close(with_memory, plain[:, 4:], atol=1e-5, rtol=0)


# -- cached == uncached --------------------------------------------------------------------------------

CACHED_CASES = [
    ("prepend", "factorized", 1, "none"),
    ("prepend", "full", 1, "none"),
    ("prepend", "factorized", 2, "none"),
    ("prepend", "full", 2, "joint"),
    ("prepend", "factorized", 1, "modulated"),
    ("channel_concat", "factorized", 1, "none"),
    ("channel_concat", "full", 1, "joint"),
    ("cross_attention", "factorized", 1, "none"),
    ("cross_attention", "full", 2, "modulated"),
]
CACHED_CASES = [(*case, []) for case in CACHED_CASES] + [("prepend", "factorized", 1, "none", DIT),
                                                         ("prepend", "full", 2, "joint", DIT)]


@pytest.mark.parametrize("structure, form, chunk, compressor, backbone", CACHED_CASES)
def test_cached_equals_uncached(structure, form, chunk, compressor, backbone):
    retention = "all" if structure == "prepend" else "last"
    budget = 2 if compressor != "none" else 0
    model = make(*backbone, f"memory.structure={structure}", f"model.temporal_attention={form}",
                 f"model.frames_per_chunk={chunk}", f"memory.compressor={compressor}", f"memory.budget={budget}",
                 f"memory.retention={retention}")
    past, past_a = frames(6, seed=1), acts(6, seed=1)
    x, levels, a = frames(2), lv(2), acts(2)
    state = model.init_state(B)
    with torch.no_grad():
        model.commit(state, past[:, :2], past_a[:, :2])  # two commits: chunk grouping must not shift
        model.commit(state, past[:, 2:], past_a[:, 2:])
        cached = model(x, levels, a, state=state)
        kept = past if retention == "all" else past[:, 2:]  # 'last' 4 of 6
        kept_a = past_a if retention == "all" else past_a[:, 2:]
        explicit = MemoryFrames(kept, kept_a, positions=torch.arange(6 - kept.shape[1], 6))
        uncached = model(x, levels, a, memory=explicit)
        from_bank = model(x, levels, a, memory=state.bank.memory())
    assert (cached - uncached).abs().max() < 1e-4
    assert torch.equal(from_bank, uncached)


def test_prepend_last_cache_matches_while_the_bank_is_filling_and_streams_after():
    model = make("memory.structure=prepend", "memory.retention=last", "memory.length=4")
    past, past_a, x, levels, a = frames(6, seed=1), acts(6, seed=1), frames(2), lv(2), acts(2)
    state = model.init_state(B)
    with torch.no_grad():
        model.commit(state, past[:, :3], past_a[:, :3])  # 3 < m: nothing dropped yet
        assert (model(x, levels, a, state=state) - model(x, levels, a, memory=MemoryFrames(past[:, :3], past_a[:, :3]))
                ).abs().max() < 1e-4
        model.commit(state, past[:, 3:], past_a[:, 3:])
        assert [len(c) for c in state.caches] == [4, 4]
        # streaming semantics: the kept frames' K/V were computed while frames 0-1 were still visible,
        # so the cached prediction differs from recomputing over the last 4 frames alone
        recomputed = model(x, levels, a, memory=state.bank.memory())
        assert (model(x, levels, a, state=state) - recomputed).abs().max() > 1e-5


# -- the memory path is live; dropped frames are dead --------------------------------------------------

@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("compressor", ["none", "joint"])
def test_memory_content_changes_the_prediction(structure, compressor):
    budget = 2 if compressor != "none" else 0
    model = make(f"memory.structure={structure}", f"memory.compressor={compressor}", f"memory.budget={budget}")
    x, levels, a = frames(2), lv(2), acts(2)
    mem = MemoryFrames(frames(4, seed=1), acts(4, seed=1))
    with torch.no_grad():
        base = model(x, levels, a, memory=mem)
        other = mem.frames.clone()
        other[:, 1] = -other[:, 1]
        assert (model(x, levels, a, memory=MemoryFrames(other, mem.actions)) - base).abs().max() > 1e-4
        other_a = (mem.actions + 1) % A
        assert (model(x, levels, a, memory=MemoryFrames(mem.frames, other_a)) - base).abs().max() > 1e-4
        assert (model(x, levels, a) - base).abs().max() > 1e-4  # no memory at all


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("retention, dropped", [("last", 0), ("sink_recent", 2)])
def test_zeroing_a_dropped_frame_changes_nothing(structure, retention, dropped):
    # m = 4; last keeps 3..6 of 7; sink 1 + recent 3 keeps 0, 4, 5, 6
    model = make(f"memory.structure={structure}", f"memory.retention={retention}", "memory.sink=1",
                 "memory.recent=3")
    past, past_a, x, levels, a = frames(7, seed=1), acts(7, seed=1), frames(2), lv(2), acts(2)
    zeroed = past.clone()
    zeroed[:, dropped] = 0
    kept = past.clone()
    kept[:, 5] = 0  # a kept frame, as the control
    outs = {}
    with torch.no_grad():
        for name, video in (("base", past), ("dropped", zeroed), ("kept", kept)):
            state = model.init_state(B)
            model.commit(state, video, past_a)
            outs[name] = model(x, levels, a, memory=state.bank.memory())
            if structure != "prepend":  # their caches are rebuilt from the bank: same guarantee
                outs[name + "_cached"] = model(x, levels, a, state=state)
    assert torch.equal(outs["dropped"], outs["base"])
    assert (outs["kept"] - outs["base"]).abs().max() > 1e-4
    if structure != "prepend":
        assert torch.equal(outs["dropped_cached"], outs["base_cached"])


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("compressor", ["none", "modulated"])
def test_gradients_flow_through_the_memory_path(structure, compressor):
    budget = 2 if compressor != "none" else 0
    model = make(f"memory.structure={structure}", f"memory.compressor={compressor}", f"memory.budget={budget}")
    model.train()
    mem_frames = frames(4, seed=1).requires_grad_(True)
    v = model(frames(2), lv(2), acts(2), memory=MemoryFrames(mem_frames, acts(4, seed=1)))
    v.pow(2).mean().backward()
    assert mem_frames.grad.abs().sum() > 0
    # every parameter takes part (DistributedDataParallel needs no find_unused_parameters)
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    if model.compressor is not None:
        assert all(p.grad.abs().sum() > 0 for p in model.compressor.parameters())


# -- checkpoints ---------------------------------------------------------------------------------------

def test_save_load_round_trips_bit_for_bit(tmp_path):
    model = make("memory.structure=cross_attention", "memory.compressor=joint", "memory.budget=2")
    x, levels, a, mem = frames(2), lv(2), acts(2), MemoryFrames(frames(4, seed=1), acts(4, seed=1))
    path = model.save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary leftovers
    loaded = Denoiser.from_pretrained(path).eval()
    assert loaded.cfg.to_dict() == model.cfg.to_dict()
    with torch.no_grad():
        assert torch.equal(loaded(x, levels, a, memory=mem), model(x, levels, a, memory=mem))
    model.save_pretrained(path)  # overwriting an existing folder works too
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]


def test_bad_checkpoints_raise_clear_errors(tmp_path):
    model = make(perturb=False)
    path = model.save_pretrained(tmp_path / "ok")
    with pytest.raises(CheckpointError, match="no config.json"):
        Denoiser.from_pretrained(tmp_path)
    # a config describing another model: shapes do not match
    cfg = json.loads((path / "config.json").read_text())
    cfg["model"]["dim"] = 64
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape mismatches: .*64"):
        Denoiser.from_pretrained(path)
    # a config with another structure: keys do not match
    cfg["model"]["dim"] = 32
    cfg["memory"]["structure"] = "cross_attention"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing keys: .*cross"):
        Denoiser.from_pretrained(path)
    cfg["memory"]["structure"] = "prepend"
    (path / "config.json").write_text(json.dumps(cfg))
    Denoiser.from_pretrained(path)  # restored: loads again
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        Denoiser.from_pretrained(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable config"):
        Denoiser.from_pretrained(path)


# -- input validation ------------------------------------------------------------------------------------

def test_invalid_inputs_and_schedules_raise_clear_errors():
    model = make("model.frames_per_chunk=2", perturb=False)
    x, levels, a = frames(4), lv(4), acts(4)
    with pytest.raises(DenoiserError, match="multiple of model.frames_per_chunk=2"):
        model(frames(3), lv(3), acts(3))
    with pytest.raises(DenoiserError, match="levels must be in 0..100"):
        model(x, levels + 200, a)
    with pytest.raises(DenoiserError, match="actions must be in 0..3"):
        model(x, levels, a + A)
    with pytest.raises(DenoiserError, match=r"x must be \(B, T, 3, 16, 16\)"):
        model(torch.zeros(B, 4, C, 8, 8), levels, a)
    state = model.init_state(B)
    with pytest.raises(DenoiserError, match="not both"):
        model(x, levels, a, memory=MemoryFrames(frames(2), acts(2)), state=state)
    with pytest.raises(DenoiserError, match="commit of 3 frames"):
        model.commit(state, frames(3), acts(3))
    with pytest.raises(DenoiserError, match="batch"):
        model(frames(4)[:1], levels[:1], a[:1], state=state)
    with pytest.raises(DenoiserError, match="delta=3 is not a multiple"):
        model.check_schedule(3, 4)
    with pytest.raises(DenoiserError, match="window=5"):
        model.check_schedule(2, 5)
    model.check_schedule(2, 8)
    cc = make("memory.structure=channel_concat", perturb=False)
    with pytest.raises(DenoiserError, match="4 memory slots"):
        cc(x, levels, a, memory=MemoryFrames(frames(6), acts(6)))


# -- training --------------------------------------------------------------------------------------------

def moving_squares(n, t, seed=0):
    """Clips of a coloured 4x4 square moved by its action (0 up, 1 down, 2 left, 3 right)."""
    g = torch.Generator().manual_seed(seed)
    video = -torch.ones(n, t, C, S, S)
    actions = torch.randint(0, A, (n, t), generator=g)
    pos = torch.randint(0, S - 4, (n, 2), generator=g)
    colour = torch.rand(n, C, generator=g) * 2 - 1
    step = torch.tensor([[-2, 0], [2, 0], [0, -2], [0, 2]])
    for i in range(t):
        pos = (pos + step[actions[:, i]]).clamp(0, S - 4)
        for j in range(n):
            video[j, i, :, pos[j, 0]:pos[j, 0] + 4, pos[j, 1]:pos[j, 1] + 4] = colour[j, :, None, None]
    return video, actions


@pytest.mark.parametrize("structure, compressor", [("prepend", "none"), ("channel_concat", "joint"),
                                                   ("cross_attention", "none"), ("prepend", "modulated")])
def test_each_structure_trains(structure, compressor):
    budget = 2 if compressor != "none" else 0
    model = make(f"memory.structure={structure}", f"memory.compressor={compressor}", f"memory.budget={budget}",
                 perturb=False).train()
    video, actions = moving_squares(8, 8)  # 4 memory + 4 window frames
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        idx = torch.randint(0, 8, (4,), generator=g)
        x0, act = video[idx], actions[idx]
        levels = torch.randint(1, 101, (4, 4), generator=g)
        ab = torch.cos((levels / 100 + 0.008) / 1.008 * math.pi / 2)[..., None, None, None] ** 2  # (4,4,1,1,1)
        noise = torch.randn(x0[:, 4:].shape, generator=g)
        x_t = ab.sqrt() * x0[:, 4:] + (1 - ab).sqrt() * noise
        v = ab.sqrt() * noise - (1 - ab).sqrt() * x0[:, 4:]
        pred = model(x_t, levels, act[:, 4:], memory=MemoryFrames(x0[:, :4], act[:, :4]))
        loss = (pred - v).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)


@pytest.mark.slow
def test_triton_kernel_path_matches_the_reference(monkeypatch):
    """The model's strided q/k/v slices through the Triton kernel (interpreter on CPU) match the reference."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")
    model = make("memory.structure=prepend", "memory.retention=all", "model.temporal_attention=full",
                 "model.frames_per_chunk=2")
    x, levels, a, past, past_a = frames(2), lv(2), acts(2), frames(4, seed=1), acts(4, seed=1)
    outs = {}
    with torch.no_grad():
        for backend in ("reference", "triton"):
            monkeypatch.setenv("ARVDM_ATTENTION_BACKEND", backend)
            state = model.init_state(B)
            model.commit(state, past, past_a)
            outs[backend] = (model(x, levels, a, state=state), model(x, levels, a, memory=MemoryFrames(past, past_a)))
    for ref, tri in zip(outs["reference"], outs["triton"]):
        assert (ref - tri).abs().max() < 1e-4
