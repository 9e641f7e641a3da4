"""Hybrid attention (arvdm.hybrid, kernels.kept_attention_mass): kept mass, lazy ratios, selection, conversion."""

import json
import math
import random

import pytest
import torch

import arvdm.hybrid as H
import kernels
from arvdm.config import Config, ConfigError, DiffusionConfig, HybridConfig, apply_overrides
from arvdm.hybrid import report as HR
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.model.layers import AttentionCall
from arvdm.pipeline.rollout import rollout
from arvdm.schedules import chunked
from memory import MemoryFrames, RetentionPolicy

K = 100
DIFF = PerFrameDiffusion(DiffusionConfig(num_levels=K))
BACKENDS = ["reference", "triton"]


def _backend(name):
    if name == "triton":
        ta = pytest.importorskip("kernels.triton_attention")
        if not ta.HAS_TRITON or not (ta.INTERPRETED or torch.cuda.is_available()):
            pytest.skip("no triton interpreter / GPU")
    return name


# -- kept attention mass ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_mass_hand_example(backend):
    """Issue 12's example: head 1 weights 4,1,1,1,1,2 (sink 0 + recent 3,4,5 keep 8 of 10); head 2 uniform
    (4 of 6 keys kept)."""
    q = torch.ones(1, 2, 1, 1)  # (B, H, Lq, D)
    k = torch.zeros(1, 2, 6, 1)
    k[0, 0, :, 0] = torch.log(torch.tensor([4.0, 1, 1, 1, 1, 2]))
    kept = kernels.kept_attention_mass(q, k, q_frame_offset=5, sink_frames=1, recent_frames=2, scale=1.0,
                                       backend=_backend(backend))
    assert kept.dtype == torch.float32 and kept.shape == (1, 2, 1)
    torch.testing.assert_close(kept, torch.tensor([[[0.8], [4 / 6]]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_mass_is_one_when_every_visible_key_is_kept(backend):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 8, 4, generator=g), torch.randn(2, 2, 20, 4, generator=g)  # 4 q frames, 10 k frames
    # window at key frames 6..9 in chunks of 2 (starting at 6 and 8): sink 3 + recent 5 keeps every key
    kept = kernels.kept_attention_mass(q, k, tokens_per_frame=2, frames_per_chunk=2, q_frame_offset=6,
                                       sink_frames=3, recent_frames=5, backend=_backend(backend))
    torch.testing.assert_close(kept, torch.ones(2, 2, 8), atol=1e-6, rtol=0)
    # one fewer recent frame drops key frame 3 for the second chunk only: 1 for the first, < 1 for the second
    kept = kernels.kept_attention_mass(q, k, tokens_per_frame=2, frames_per_chunk=2, q_frame_offset=6,
                                       sink_frames=3, recent_frames=4, backend=_backend(backend))
    torch.testing.assert_close(kept[:, :, :4], torch.ones(2, 2, 4), atol=1e-6, rtol=0)
    assert (kept[:, :, 4:] < 1 - 1e-4).all()


def _oracle(q, k, scale, **rule):
    """float64 dense softmax under the full rule, summed over the keys the streaming rule keeps."""
    full = kernels.chunked_attention_mask(q.shape[2], k.shape[2], **dict(rule, sink_frames=0, recent_frames=None))
    kept = kernels.chunked_attention_mask(q.shape[2], k.shape[2], **rule)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    p = torch.softmax(s.masked_fill(~full, -math.inf), dim=-1)
    return (p * kept).sum(-1)  # (B, H, Lq)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tpf, chunk, off, nq, nk, sink, recent", [
    (1, 1, 12, 6, 18, 2, 3), (3, 2, 5, 4, 11, 1, 2), (2, 3, 9, 6, 15, 0, 4)])
def test_kept_mass_matches_float64_oracle(backend, tpf, chunk, off, nq, nk, sink, recent):
    g = torch.Generator().manual_seed(tpf * 100 + nk)
    q = torch.randn(2, 3, nq * tpf, 8, generator=g) * 2
    k = torch.randn(2, 3, nk * tpf, 8, generator=g) * 2
    rule = dict(tokens_per_frame=tpf, frames_per_chunk=chunk, q_frame_offset=off, sink_frames=sink,
                recent_frames=recent)
    kept = kernels.kept_attention_mass(q, k, scale=0.3, backend=_backend(backend), **rule)
    want = _oracle(q, k, 0.3, **rule)
    assert want.min() < 0.9  # not vacuous: the streaming rule drops real mass
    torch.testing.assert_close(kept.double(), want, atol=2e-5, rtol=0)
    # the online path (reusing the attention's own full lse) gives the same numbers
    _, lse = kernels.chunked_attention(q, k, k, scale=0.3, return_lse=True, backend=backend,
                                       **dict(rule, sink_frames=0, recent_frames=None))
    again = kernels.kept_attention_mass(q, k, scale=0.3, backend=backend, lse_full=lse, **rule)
    torch.testing.assert_close(again, kept, atol=1e-6, rtol=0)


def test_kept_mass_bad_input_errors():
    q, k = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="recent_frames"):
        kernels.kept_attention_mass(q, k, q_frame_offset=2, recent_frames=None)
    with pytest.raises(ValueError, match="runs past"):
        kernels.kept_attention_mass(q, k, q_frame_offset=3, recent_frames=1)
    with pytest.raises(ValueError, match="lse_full"):
        kernels.kept_attention_mass(q, k, q_frame_offset=2, recent_frames=1, lse_full=torch.zeros(1, 1, 3))


# -- selection -------------------------------------------------------------------------------------------
def test_selection_equals_sorting_with_ties_by_index():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        ratios = [rng.choice([0.5, 0.7, 0.9, 0.99]) for _ in range(n)]  # many ties
        f = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])
        k = H.num_streaming(n, f)
        want = sorted(sorted(range(n), key=lambda i: (-ratios[i], i))[:k])
        assert H.select_layers(ratios, f) == want
    assert H.select_layers([0.9, 0.9, 0.9, 0.9], 0.5) == [0, 1]  # ties: the lower layer index wins
    assert H.select_layers([0.1, float("nan"), 0.2], 1 / 3) == [2]  # never-measured layers rank last
    assert [H.num_streaming(4, f) for f in (0, 0.25, 0.5, 0.75, 1)] == [0, 1, 2, 3, 4]


# -- the model -------------------------------------------------------------------------------------------
def tiny_model(depth=4, retention="all", length=0):
    from arvdm.model.denoiser import Denoiser

    cfg = Config()
    m = cfg.model
    m.image_size, m.patch_size, m.dim, m.depth, m.heads, m.num_actions = 16, 4, 32, depth, 2, 6
    cfg.memory.retention, cfg.memory.length = retention, length
    cfg.diffusion.num_levels = K
    torch.manual_seed(0)
    model = Denoiser(cfg).eval()
    with torch.no_grad():  # lift the zero-inits so every layer's attention matters
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def clip(t, seed=0, b=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, t, 3, 16, 16, generator=g) * 2 - 1, torch.randint(0, 6, (b, t), generator=g)


def test_temporal_layers_are_the_blocks_and_generic_fallback():
    model = tiny_model(depth=3)
    assert H.temporal_layers(model) == [b.temporal for b in model.blocks]

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.retention, self.lse_observers = None, []

    other = torch.nn.Sequential(torch.nn.Linear(2, 2), Layer(), Layer())
    assert H.temporal_layers(other) == [other[1], other[2]]
    with pytest.raises(H.HybridError, match="no temporal-attention layer"):
        H.temporal_layers(torch.nn.Linear(2, 2))


def test_online_ratio_equals_offline_on_same_inputs():
    """Committing m + w clean frames (online, during the commit) and the offline calibration at level 0
    (m memory frames + a clean window) give each layer the same queries and keys: the same ratios."""
    model = tiny_model()
    h = HybridConfig(sink=1, recent=2, last_frames=2)
    frames, actions = clip(10)
    state = model.init_state(1)
    with H.measuring(H.temporal_layers(model), sink=1, recent=2, last_frames=2) as meters:
        model.commit(state, frames, actions)
    online = [m.ratio for m in meters]
    offline = HR.calibrate(model, DIFF, frames, actions, memory=6, levels=[0], hybrid=h, progress=False)
    assert len(set(round(r, 4) for r in online)) > 1 and max(online) < 1  # layers differ, mass is dropped
    torch.testing.assert_close(torch.tensor(offline["ratios"]), torch.tensor(online), atol=1e-5, rtol=0)
    # noisier windows are measured too, one column per level
    noisy = HR.calibrate(model, DIFF, frames, actions, memory=6, levels=[0, 50, 100], hybrid=h, progress=False)
    assert len(noisy["layers"][0]["by_level"]) == 3 and noisy["layers"][0]["by_level"][0] == pytest.approx(
        online[0], abs=1e-5)
    with pytest.raises(H.HybridError, match="every ratio would be 1"):
        HR.calibrate(model, DIFF, frames[:, :4], actions[:, :4], memory=2, levels=[0],
                    hybrid=HybridConfig(sink=1, recent=2, last_frames=2), progress=False)


def _go(model, n=8, n_ctx=8, seed=1):
    ctx, ctx_act = clip(n_ctx, seed=0)
    act = torch.randint(0, 6, (1, n), generator=torch.Generator().manual_seed(5))
    return rollout(model, DIFF, chunked(4, K, 2), ctx, ctx_act, act, n, eta=0.5,
                   generator=torch.Generator().manual_seed(seed), progress=False)


def test_fraction_zero_reproduces_the_base_rollout_bit_for_bit():
    model = tiny_model()
    base = _go(model)
    hm = H.HybridModel(model, HybridConfig(fraction=0.0, select="online", sink=1, recent=2))
    assert torch.equal(_go(hm), base)
    assert hm.selections == [{"layers": [], "ratios": hm.selections[0]["ratios"], "source": "online"}]
    # a real fraction does change the rollout (the comparison is not vacuous)
    hm = H.HybridModel(model, HybridConfig(fraction=0.5, select="online", sink=1, recent=2))
    assert (_go(hm) - base).abs().max() > 1e-3
    assert len(hm.selections[0]["layers"]) == 2 and hm.streaming_layers == hm.selections[0]["layers"]
    ratios = hm.selections[0]["ratios"]
    assert hm.selections[0]["layers"] == H.select_layers(ratios, 0.5)


def test_conversion_leaves_full_layers_alone_and_cutting_streaming_caches_is_lossless():
    model = tiny_model()
    layers = H.temporal_layers(model)
    frames, actions = clip(12)
    state = model.init_state(1)
    model.commit(state, frames, actions)
    before = [c.keys_values() for c in state.caches]
    before = [(k.clone(), v.clone()) for k, v in before]
    x = torch.randn(1, 3, 16, 32)  # (B, T, N, D) a window's tokens
    cos, sin = model.rope(torch.arange(12, 15))
    outs_full = [layer(x, cos, sin, past=cache)[0] for layer, cache in zip(layers, state.caches)]
    for layer in layers:  # the streaming mask alone, on the full (uncut) cache
        layer.retention = H.streaming_policy(2, 3)
    outs_mask = [layer(x, cos, sin, past=cache)[0] for layer, cache in zip(layers, state.caches)]

    H.convert_layers(layers, [1, 3], sink=2, recent=3, caches=state.caches, n_committed=state.n_committed)
    assert [layer.streaming for layer in layers] == [None, (2, 3), None, (2, 3)]
    for i in (0, 2):  # full layers: the same cache and the same output on the same inputs
        assert state.caches[i].frame_ids == list(range(12))
        assert torch.equal(state.caches[i].keys_values()[0], before[i][0])
        assert torch.equal(layers[i](x, cos, sin, past=state.caches[i])[0], outs_full[i])
    for i in (1, 3):  # streaming layers: cut at once to sink + recent, same output as the mask on the full cache
        assert state.caches[i].frame_ids == [0, 1, 9, 10, 11]
        out = layers[i](x, cos, sin, past=state.caches[i])[0]
        torch.testing.assert_close(out, outs_mask[i], atol=1e-5, rtol=0)
        assert (out - outs_full[i]).abs().max() > 1e-3


def test_streaming_caches_stay_bounded_through_a_300_frame_rollout():
    model = tiny_model(depth=2)
    hm = H.HybridModel(model, HybridConfig(fraction=0.5, select="fixed", layers=[1], sink=2, recent=3))
    sizes = []
    commit = hm.commit

    def spy(state, frames, actions, poses=None):
        commit(state, frames, actions, poses)
        sizes.append([c.num_frames for c in state.caches])

    hm.commit = spy
    _go(hm, n=300, n_ctx=4)
    assert max(s[1] for s in sizes) == 5  # sink 2 + recent 3, from the context on
    assert sizes[-1][0] == 4 + 296  # the full layer remembers everything (retention all)
    assert hm.last_state.caches[1].frame_ids == [0, 1, 297, 298, 299]


def test_compiled_hybrid_model_matches_eager(monkeypatch):
    """sample.py --hybrid F --compile: torch.compile takes a HybridModel (an nn.Module around the denoiser);
    aot_eager traces the same graphs as inductor without its slow C++ code generation on a CPU."""
    import functools

    from arvdm.sampling import compile_for_sampling

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    model = tiny_model(depth=2)
    h = HybridConfig(fraction=0.5, select="online", sink=1, recent=2)
    eager_hm = H.HybridModel(model, h)
    eager = _go(eager_hm)
    compiled_hm = compile_for_sampling(H.HybridModel(model, h))
    assert isinstance(compiled_hm, torch.nn.Module) and isinstance(compiled_hm._orig_mod, H.HybridModel)
    compiled = _go(compiled_hm)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    assert compiled_hm.selections[0]["layers"] == eager_hm.selections[0]["layers"] != []


def test_online_falls_back_to_offline_for_a_short_context(tmp_path):
    model = tiny_model()
    h = HybridConfig(fraction=0.25, select="online", sink=2, recent=4)
    with pytest.raises(H.HybridError, match="no offline lazy ratios"):
        _go(H.HybridModel(model, h), n_ctx=4)
    hm = H.HybridModel(model, h, offline={"ratios": [0.1, 0.2, 0.9, 0.3]})
    _go(hm, n_ctx=4)
    assert hm.selections[0]["layers"] == [2] and hm.selections[0]["source"].startswith("offline")


# -- config, training and sampling wiring -----------------------------------------------------------------
def test_hybrid_config_keys_and_errors():
    cfg = apply_overrides(Config(), ["hybrid.fraction=0.5", "hybrid.select=fixed", "hybrid.layers=[0,2]",
                                     "hybrid.sink=1", "hybrid.recent=3", "hybrid.last_frames=1"])
    cfg.validate()
    assert cfg.hybrid.layers == [0, 2] and cfg.hybrid.active
    assert Config.from_dict(json.loads(cfg.to_json())).hybrid == cfg.hybrid
    for bad, what in (("hybrid.fraction=1.5", "hybrid.fraction"), ("hybrid.select=best", "hybrid.select"),
                      ("hybrid.layers=[1,1]", "hybrid.layers"), ("hybrid.recent=0", "hybrid.recent")):
        with pytest.raises(ConfigError, match=what):
            apply_overrides(Config(), [bad]).validate()


def test_training_wiring_streams_the_chosen_layers_and_records_them(tmp_path):
    model = tiny_model()
    (tmp_path / H.RATIOS_NAME).write_text(json.dumps({"ratios": [0.5, 0.95, 0.4, 0.9]}))
    cfg = apply_overrides(Config(), ["hybrid.fraction=0.5", "hybrid.select=offline"])
    assert H.apply_for_training(model, cfg, tmp_path) == [1, 3]
    assert [b.temporal.streaming for b in model.blocks] == [None, (2, 4), None, (2, 4)]
    assert (cfg.hybrid.select, cfg.hybrid.layers) == ("fixed", [1, 3])
    assert model.cfg.hybrid.layers == [1, 3]
    # training forward with explicit memory goes through the streaming masks (and still backpropagates)
    model.train()
    frames, actions = clip(12)
    v = model(frames[:, 8:], torch.full((1, 4), 50), actions[:, 8:], memory=MemoryFrames(frames[:, :8], actions[:, :8]))
    v.square().mean().backward()
    with pytest.raises(H.HybridError, match="select=online"):
        H.apply_for_training(tiny_model(), apply_overrides(Config(), ["hybrid.fraction=0.5"]), tmp_path)
    with pytest.raises(H.HybridError, match="calibrate"):
        H.apply_for_training(tiny_model(), apply_overrides(Config(), ["hybrid.fraction=0.5", "hybrid.select=offline"]),
                             tmp_path / "elsewhere")


def test_sampling_wiring_and_refusals(tmp_path):
    model = tiny_model(retention="last", length=8)
    same, h = H.wrap_for_sampling(model, model.cfg, tmp_path, None)
    assert same is model and not h.active
    hm, h = H.wrap_for_sampling(model, model.cfg, tmp_path, {"fraction": 0.5, "sink": 1, "recent": 3})
    assert isinstance(hm, H.HybridModel) and h.select == "online"
    _go(hm)
    text = H.describe(hm.summary())
    assert "streaming layers" in text and str(hm.selections[0]["layers"]) in text
    with pytest.raises(H.HybridError, match="save nothing"):
        H.wrap_for_sampling(model, model.cfg, tmp_path, {"fraction": 0.5, "sink": 4, "recent": 4})
    with pytest.raises(H.HybridError, match="out of range"):
        H.wrap_for_sampling(model, model.cfg, tmp_path, {"select": "fixed", "layers": [7]})
    with pytest.raises(H.HybridError, match="unknown hybrid key"):
        H.wrap_for_sampling(model, model.cfg, tmp_path, {"fractoin": 0.5})


def test_cli_errors_exit_2_without_traceback(tmp_path, capsys):
    assert HR.main(["calibrate", "--run", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


# -- end to end on a tiny run: fine-tune wiring, calibrate, sample.py --hybrid, report -------------------
TINY = ["model.image_size=16", "data.resize=0", "model.patch_size=4", "model.dim=32", "model.depth=2", "model.heads=2",
        "memory.length=8", "train.window=4", "train.batch_size=2", "train.max_steps=2", "train.ckpt_every=2",
        "train.val_every=1000", "train.sample_every=0", "train.warmup_steps=1", "diffusion.num_levels=100",
        "hybrid.sink=1", "hybrid.recent=2", "hybrid.last_frames=1"]


def _train_tiny(root, poses: bool = False, overrides=()):
    """A 2-step tiny run on random 16 px episodes (with camera poses when ``poses``) in ``root``; returns root."""
    import numpy as np

    from arvdm.config import get_preset
    from arvdm.training.trainer import Trainer

    rng = np.random.default_rng(1 if poses else 0)
    for split, n in (("training", 2), ("validation", 2)):
        (root / "data" / split).mkdir(parents=True)
        for i in range(n):
            arrays = {"video": rng.integers(0, 256, (40, 16, 16, 3), dtype=np.uint8), "actions": rng.integers(0, 6, 40)}
            if poses:
                arrays["pose"] = np.stack([np.arange(40) % 7, np.zeros(40), np.linspace(-3, 3, 40)],
                                          axis=1).astype(np.float32)
            np.savez(root / "data" / split / f"ep_{i:06d}.npz", **arrays)
    cfg = apply_overrides(get_preset("tiny_time"), TINY + [f"data.path={root / 'data'}", *overrides]).validate()
    Trainer(cfg, root / "run").fit()
    return root


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return _train_tiny(tmp_path_factory.mktemp("hybrid"))


def test_fine_tune_mode_trains_streaming_layers_and_saves_them(tiny_run):
    from arvdm.config import get_preset
    from arvdm.model.checkpoint import latest_checkpoint, load_config
    from arvdm.training.trainer import Trainer

    (tiny_run / "ft").mkdir()
    (tiny_run / "ft" / H.RATIOS_NAME).write_text(json.dumps({"ratios": [0.3, 0.8]}))
    cfg = apply_overrides(get_preset("tiny_time"), TINY + [f"data.path={tiny_run / 'data'}", "hybrid.fraction=0.5",
                                                      "hybrid.select=offline"]).validate()
    trainer = Trainer(cfg, tiny_run / "ft")
    assert [b.temporal.streaming for b in trainer.model.blocks] == [None, (1, 2)]
    trainer.fit()
    saved = load_config(latest_checkpoint(tiny_run / "ft")).hybrid
    assert (saved.select, saved.layers, saved.fraction) == ("fixed", [1], 0.5)


def test_calibrate_sample_and_report_clis(tiny_run, tmp_path, capsys):
    import sample

    run = str(tiny_run / "run")
    assert HR.main(["calibrate", "--run", run, "--clips", "2", "--levels", "2"]) == 0
    ratios = H.load_lazy_ratios(tiny_run / "run" / H.RATIOS_NAME)
    assert len(ratios["ratios"]) == 2 and ratios["levels"] == [0, 100] and 0 < min(ratios["ratios"]) < 1
    assert sample.main(["--run", run, "--frames", "8", "--context", "8", "--episodes", "1", "--steps", "2",
                        "--hybrid", "0.5", "--eval", "--out", str(tmp_path / "s")]) == 0
    assert "hybrid batch 0: streaming layers [" in capsys.readouterr().out
    ev = json.loads((tmp_path / "s" / "eval.json").read_text())
    assert ev["hybrid"]["fraction"] == 0.5 and len(ev["hybrid"]["selections"][0]["layers"]) == 1
    assert sample.main(["--run", run, "--set", "hybrid.select=best", "--out", str(tmp_path / "x")]) == 2
    assert "hybrid.select" in capsys.readouterr().err
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "pareto.csv").write_text("name,max_psnr_decay,mean_retrieval_rate,on_frontier\n"
                                                  "prepend-m8,1.5,0.25,1\n")
    assert HR.main(["report", "--run", run, "--episodes", "1", "--frames", "8", "--steps", "2",
                   "--out", str(tmp_path / "r"), "--pareto-with", str(tmp_path / "grid")]) == 0
    assert "prepend-m8" in (tmp_path / "r" / "pareto_hybrid.csv").read_text()
    rows = json.loads((tmp_path / "r" / "hybrid_report.json").read_text())["rows"]
    # 2 layers: fractions .25 and .5 both make 1 layer stream (kept once), .75 makes 2
    assert [(r["selection"], r["fraction"]) for r in rows] == [("base", 0.0)] + [
        (s, f) for f in (0.25, 0.75) for s in ("lazy", "random", "last")]
    assert rows[-1]["kv_vs_base"] < rows[1]["kv_vs_base"] < 1
    assert all((tmp_path / "r" / f).is_file() for f in ("lazy_ratios.png", "hybrid_report.md", "pareto_hybrid.png"))


@pytest.fixture(scope="module")
def pose_run(tmp_path_factory):
    """A tiny run that chooses its memory by camera pose (the `tiny` preset's way), on episodes with poses."""
    root = _train_tiny(tmp_path_factory.mktemp("hybrid_pose"), poses=True,
                       overrides=("memory.select=pose", "memory.pose_frames=2"))
    return root / "run"


def test_calibrate_and_report_a_pose_aware_run(pose_run, tmp_path):
    """The `tiny` preset chooses memory by pose: calibration gives its memory the clips' poses and ages (as training
    does), the report's rollouts the episodes' poses; without poses the calibration is refused by name."""
    assert HR.main(["calibrate", "--run", str(pose_run), "--clips", "2", "--levels", "2"]) == 0
    ratios = H.load_lazy_ratios(pose_run / H.RATIOS_NAME)
    assert len(ratios["ratios"]) == 2 and 0 < min(ratios["ratios"]) < 1
    assert HR.main(["report", "--run", str(pose_run), "--episodes", "1", "--frames", "8", "--steps", "2",
                    "--out", str(tmp_path / "r")]) == 0
    rows = json.loads((tmp_path / "r" / "hybrid_report.json").read_text())["rows"]
    assert [(r["selection"], r["fraction"]) for r in rows] == [("base", 0.0)] + [
        (s, f) for f in (0.25, 0.75) for s in ("lazy", "random", "last")]
    assert rows[-1]["psnr_mean"] != rows[0]["psnr_mean"]  # the streaming layers do attend to less
    from arvdm.pipeline.runs import load_for_inference

    model, cfg = load_for_inference(pose_run, device="cpu")
    clips = torch.zeros(1, cfg.memory.length + cfg.train.window, 3, 16, 16)
    with pytest.raises(H.HybridError, match="pose-aware"):
        HR.calibrate(model, PerFrameDiffusion(cfg.diffusion), clips, torch.zeros(clips.shape[:2], dtype=torch.long),
                     memory=cfg.memory.length, levels=[50], hybrid=cfg.hybrid, progress=False)


def test_selection_strategies():
    s = HR.selection_strategies([0.2, 0.9, 0.5, 0.7], 0.5, seed=3)
    assert s["lazy"] == [1, 3] and s["last"] == [2, 3] and len(s["random"]) == 2
    assert HR.selection_strategies([0.2, 0.9, 0.5, 0.7], 0.5, seed=3)["random"] == s["random"]  # seeded


# -- issue 22: sinks survive a `last` memory shorter than the context; converted caches are freed ---------------
def _window(seed=7, t=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, t, 3, 16, 16, generator=g), torch.randint(0, K + 1, (1, t), generator=g),
            torch.randint(0, 6, (1, t), generator=g))


def test_online_streaming_layers_keep_absolute_sinks_past_a_short_last_memory():
    """select=online, memory.retention=last (8 frames) and a 16-frame context: the streaming layers must hold
    the absolute frames 0..s-1 plus the recent ones (issue 22: they held 13-15, then 17-19), with the same
    keys and outputs as a reference that commits the context with every layer full and caches per layer
    exactly what each should keep (plain Denoiser + KVCache policies, no arvdm.hybrid code)."""
    sink, recent, length = 2, 3, 8
    hm = H.HybridModel(tiny_model(retention="last", length=length),
                       HybridConfig(fraction=0.5, select="online", sink=sink, recent=recent))
    ctx, ctx_act = clip(16)
    state = hm.init_state(1)
    hm.commit(state, ctx, ctx_act)
    chosen = hm.streaming_layers
    assert len(chosen) == 2

    ref = tiny_model(retention="last", length=length)  # same weights (seeded), its own layers
    stream, base = H.streaming_policy(sink, recent), RetentionPolicy("last", length=length)
    ref_state = ref.init_state(1, layer_policies=[stream if i in chosen else base for i in range(4)])
    ref.commit(ref_state, ctx, ctx_act)  # every layer full while the context is committed
    for i in chosen:
        ref.blocks[i].temporal.retention = stream

    def check(n):
        for i, (c, rc) in enumerate(zip(state.caches, ref_state.caches)):
            want = [0, 1] + list(range(n - recent, n)) if i in chosen else list(range(n - length, n))
            assert c.frame_ids == want, f"layer {i}: holds {c.frame_ids}, should hold {want}"
            assert rc.frame_ids == want
            torch.testing.assert_close(c.keys_values()[0], rc.keys_values()[0], atol=1e-5, rtol=0)
        x, lv, act = _window(seed=n)
        with torch.no_grad():
            out, want_out = hm(x, lv, act, state=state), ref(x, lv, act, state=ref_state)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=0)

    check(16)
    for n in (20, 24):  # later commits: the sinks stay, the recent frames slide
        frames, acts = clip(4, seed=n)
        hm.commit(state, frames, acts)
        ref.commit(ref_state, frames, acts)
        check(n)


def test_conversion_frees_the_long_cache_buffer_and_the_buffer_stays_bounded():
    sink, recent = 2, 3
    hm = H.HybridModel(tiny_model(), HybridConfig(fraction=0.5, select="online", sink=sink, recent=recent))
    ctx, ctx_act = clip(40)
    state = hm.init_state(1)
    hm.commit(state, ctx, ctx_act)  # one commit of 40 frames: every buffer holds >= 40 frames
    per_frame = state.caches[0].nbytes() // 40
    chosen = hm.streaming_layers
    assert len(chosen) == 2
    for i, c in enumerate(state.caches):
        if i in chosen:  # the buffer is reallocated to exactly the kept frames: the 40-frame one is gone
            assert c.frame_ids == [0, 1, 37, 38, 39]
            assert c.capacity_nbytes() == c.nbytes() == (sink + recent) * per_frame
            assert c._k.untyped_storage().nbytes() == (sink + recent) * per_frame // 2  # K's storage, not a view
        else:
            assert c.capacity_nbytes() >= 40 * per_frame
    caps = []
    for n in range(40, 240, 4):  # later commits regrow it to a small working size, never to the old one
        frames, acts = clip(4, seed=n)
        x, lv, act = _window(seed=n)
        with torch.no_grad():
            hm(x, lv, act, state=state)  # the window's K/V go into the slack too
        hm.commit(state, frames, acts)
        caps.append([state.caches[i].capacity_nbytes() // per_frame for i in chosen])
    assert max(max(c) for c in caps) <= 4 * (sink + recent + 4)
    assert caps[-1] == caps[len(caps) // 2]  # steady: no growth
    assert state.caches[chosen[0]].frame_ids == [0, 1, 237, 238, 239]


def test_convert_refuses_a_cache_that_lost_its_sinks():
    model = tiny_model(retention="last", length=8)
    layers = H.temporal_layers(model)
    state = model.init_state(1)
    model.commit(state, *clip(16))  # the plain model's `last` memory: frames 8..15 only
    with pytest.raises(H.HybridError, match=r"layer 1's KV cache no longer holds frames \[0, 1\]"):
        H.convert_layers(layers, [1], sink=2, recent=3, caches=state.caches, n_committed=16)
    assert [layer.retention for layer in layers] == [None] * 4  # nothing changed
    assert [c.frame_ids for c in state.caches] == [list(range(8, 16))] * 4
    # a cache that still holds them converts (and the check does not get in the way of a plain cut)
    state = model.init_state(1, layer_policies=[RetentionPolicy("sink_recent", sink=2, recent=8)] * 4)
    model.commit(state, *clip(16))
    H.convert_layers(layers, [1], sink=2, recent=3, caches=state.caches, n_committed=16)
    assert state.caches[1].frame_ids == [0, 1, 13, 14, 15] and state.caches[0].frame_ids == [0, 1] + list(range(8, 16))


def _brute_lazy_ratio(q, k, *, tpf, chunk, off, sink, recent, last_frames):
    """LightTransfer's lazy ratio by hand, float64: per query token of the last frames, its softmax over the
    keys the block-causal rule lets it see, summed over the sink keys and (separately) the recent keys."""
    q, k = q.double(), k.double()
    nq, nk = q.shape[2] // tpf, k.shape[2] // tpf
    key_frame = torch.arange(nk * tpf) // tpf
    sink_mass, recent_mass = [], []
    for i in range((nq - last_frames) * tpf, nq * tpf):
        f_q = off + i // tpf
        start = off + (f_q - off) // chunk * chunk  # the query's chunk: [start, start + chunk)
        visible = key_frame < start + chunk
        s = torch.einsum("bhd,bhkd->bhk", q[:, :, i], k) / math.sqrt(q.shape[-1])  # (B, H, Lk)
        p = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1)
        is_sink = key_frame < sink
        is_recent = (key_frame >= start - recent) & ~is_sink
        sink_mass.append((p * is_sink).sum(-1))
        recent_mass.append((p * is_recent).sum(-1))
    return torch.stack(sink_mass, -1).mean().item(), torch.stack(recent_mass, -1).mean().item()


@pytest.mark.parametrize("tpf, chunk", [(1, 1), (2, 2)])
def test_lazy_ratio_meter_counts_sink_and_recent_mass(tpf, chunk):
    """The meter against an independent brute-force sum where the sinks carry much of the mass: a meter that
    drops the sink term (or the recent one) misses by far more than the tolerance."""
    sink, recent, last_frames, off, nq, nk, d = 2, 3, 2, 6, 6, 12, 8
    g = torch.Generator().manual_seed(tpf)
    u = torch.randn(d, generator=g)
    q = torch.randn(2, 2, nq * tpf, d, generator=g) + u
    k = torch.randn(2, 2, nk * tpf, d, generator=g)
    k[:, :, :sink * tpf] += u  # the sink keys align with every query
    _, lse = kernels.chunked_attention(q, k, k, tokens_per_frame=tpf, frames_per_chunk=chunk, q_frame_offset=off,
                                       return_lse=True, backend="reference")
    call = AttentionCall(q, k, lse, tpf, chunk, off, 0, None)  # a full-attention layer's kernel call
    meter = H.LazyRatioMeter(sink=sink, recent=recent, last_frames=last_frames)
    meter(call)
    sink_mass, recent_mass = _brute_lazy_ratio(q, k, tpf=tpf, chunk=chunk, off=off, sink=sink, recent=recent,
                                               last_frames=last_frames)
    assert sink_mass > 0.3 and recent_mass > 0.1 and sink_mass + recent_mass < 0.95  # both terms matter, mass dropped
    assert meter.ratio == pytest.approx(sink_mass + recent_mass, abs=1e-5)
    # a streaming layer's call is not measured (its lse is not the full one)
    meter(AttentionCall(q, k, lse, tpf, chunk, off, sink, recent))
    assert len(meter.calls) == 1


def test_keeping_sinks_keeps_the_union_of_the_memory_and_the_streaming_policy():
    stream = H.streaming_policy(2, 3)
    for base in (RetentionPolicy("all"), RetentionPolicy("last", length=8), RetentionPolicy("last", length=1),
                 RetentionPolicy("sink_recent", sink=1, recent=10), RetentionPolicy("sink_recent", sink=4, recent=2)):
        union = H.keeping_sinks(base, 2, 3)
        for n in range(40):
            want = sorted(set(base.kept_indices(n)) | set(stream.kept_indices(n)))
            assert union.kept_indices(n) == want, (base, n)
