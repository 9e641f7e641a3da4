"""`train.fsdp`: two gloo ranks on the CPU shard the model (FSDP2) and follow DDP's trajectory; checkpoints are
full and interchangeable with DDP's; a killed FSDP run resumes bit for bit."""

from __future__ import annotations

import copy
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_training import POSE, ROLLOUT, TINY, tiny_cfg, write_episodes

from arvdm.config import ConfigError
from arvdm.model.checkpoint import latest_checkpoint, load_config
from arvdm.model.denoiser import Denoiser
from arvdm.training import sharding
from arvdm.training.objective import EMA
from arvdm.training.power_ema import PostHocEMA, snapshot_path
from arvdm.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

# pose memory with noisy context and the anchor, memory dropped in about half the steps (its parameters then get no
# gradient), two micro-batches per step (no gradient sync on the first), and rollout-trained context (the EMA
# model generates memory frames in every step, so the sharded EMA is gathered every step)
CONFIG = TINY + POSE + ROLLOUT + ["train.memory_dropout=0.5", "train.grad_accum=2", "train.max_steps=4",
                                  "train.ckpt_every=2", "train.val_every=2", "train.val_batches=3",
                                  "train.sample_every=4", "train.members=1"]  # one model (tiny trains two)


def _torchrun(tmp_path: Path, data: Path, out: Path, *extra: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "train.py"), "--data", str(data), "--out", str(out), "--device", "cpu", *extra]
    proc = subprocess.run(cmd, check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _train(tmp_path: Path, data: Path, out: Path, fsdp: bool) -> None:
    sets = CONFIG + [f"train.fsdp={str(fsdp).lower()}"]
    _torchrun(tmp_path, data, out, "--preset", "tiny", *[a for s in sets for a in ("--set", s)])


def _resume_from_step2(tmp_path: Path, data: Path, src: Path, out: Path, fsdp: bool) -> None:
    """`src`'s run killed after its step-2 checkpoint, resumed to step 4 under FSDP or DDP."""
    shutil.copytree(src, out)
    shutil.rmtree(out / "checkpoints/step_0000004")
    _torchrun(tmp_path, data, out, "--resume", "--set", f"train.fsdp={str(fsdp).lower()}")


def _weights(run: Path, name: str, step: int = 4) -> dict[str, torch.Tensor]:
    return load_file(str(run / f"checkpoints/step_{step:07d}/{name}.safetensors"))


def _optimizer(run: Path) -> dict:
    return torch.load(run / "checkpoints/step_0000004/state.pt", weights_only=True)["optimizer"]


def _val_losses(run: Path) -> list[tuple[float, float]]:
    rows = csv.DictReader((run / "log.csv").read_text().splitlines())
    return [(float(r["val_loss"]), float(r["val_loss_ema"])) for r in rows if r["val_loss"]]


def _assert_close_runs(a: Path, b: Path, atol: float = 1e-5) -> None:
    """Two runs of the same training to float rounding: weights, EMA, optimizer state, validation losses."""
    for name in ("model", "ema"):
        wa, wb = _weights(a, name), _weights(b, name)
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=f"{name} {k}")
    oa, ob = _optimizer(a), _optimizer(b)
    assert [g["params"] for g in oa["param_groups"]] == [g["params"] for g in ob["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in oa["param_groups"]] == \
           [{k: v for k, v in g.items() if k != "params"} for g in ob["param_groups"]]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():  # step, exp_avg, exp_avg_sq: the second moment is the touchiest
            torch.testing.assert_close(v, ob["state"][i][k], rtol=2e-2, atol=1e-9, msg=f"optimizer {i} {k}")
    la, lb = _val_losses(a), _val_losses(b)
    assert len(la) == len(lb) == 2
    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=0)


@pytest.mark.slow  # five two-rank launches of train.py: ~2 min on a 2-core CPU
def test_fsdp_follows_ddp_and_resumes_exactly(tmp_path):
    data = write_episodes(tmp_path / "data", n_train=6, poses=True)
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    _train(tmp_path, data, ddp, fsdp=False)
    _train(tmp_path, data, fsdp, fsdp=True)

    # The same trajectory as DDP (gradients reduce-scattered instead of all-reduced: float rounding only); the
    # weights moved, so agreement is not the initial weights agreeing. Full checkpoints, one sample video.
    end, mid = _weights(fsdp, "model"), _weights(fsdp, "model", 2)
    assert max((end[k] - mid[k]).abs().max() for k in end) > 1e-3
    _assert_close_runs(ddp, fsdp)
    assert sorted(p.name for p in (fsdp / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert (fsdp / "samples/step_0000004.mp4").stat().st_size > 0

    # Killed after step 2 and resumed under FSDP: bit for bit the unbroken FSDP run.
    resumed = tmp_path / "fsdp_resumed"
    _resume_from_step2(tmp_path, data, fsdp, resumed, fsdp=True)
    for name in ("model", "ema"):
        a, b = _weights(fsdp, name), _weights(resumed, name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    oa, ob = _optimizer(fsdp), _optimizer(resumed)
    assert all(torch.equal(v, ob["state"][i][k]) for i in oa["state"] for k, v in oa["state"][i].items())

    # One checkpoint format: a DDP checkpoint resumes under FSDP, an FSDP one under DDP, both on DDP's trajectory.
    ddp_to_fsdp, fsdp_to_ddp = tmp_path / "ddp_to_fsdp", tmp_path / "fsdp_to_ddp"
    _resume_from_step2(tmp_path, data, ddp, ddp_to_fsdp, fsdp=True)
    _resume_from_step2(tmp_path, data, fsdp, fsdp_to_ddp, fsdp=False)
    _assert_close_runs(ddp, ddp_to_fsdp)
    _assert_close_runs(ddp, fsdp_to_ddp)


def test_fsdp_needs_several_processes(tmp_path):
    cfg = tiny_cfg(write_episodes(tmp_path / "data"), "train.fsdp=true")
    with pytest.raises(ConfigError, match=r"train\.fsdp=true .* several processes"):
        Trainer(cfg, tmp_path / "run", device="cpu")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # two two-rank launches of train.py: ~40 s on a 2-core CPU
def test_fsdp_hybrid_fine_tune_follows_ddp(tmp_path):
    """Hybrid fine-tune mode (LightTransfer: layer 1 made streaming before training) under FSDP: the conversion
    happens before sharding, so the sharded run trains the same streaming model as DDP and saves its layers."""
    data = write_episodes(tmp_path / "data", n_train=6, length=16)
    # a 6-frame memory against sink 1 + recent 2: the streaming layer really drops keys (DDP and FSDP would part
    # ways if sharding lost the conversion)
    sets = TINY + ["model.depth=2", "memory.length=6", "hybrid.fraction=0.5", "hybrid.select=fixed",
                   "hybrid.layers=[1]", "hybrid.sink=1", "hybrid.recent=2", "train.max_steps=4", "train.ckpt_every=2",
                   "train.val_every=2", "train.val_batches=2"]
    runs = {}
    for fsdp in (False, True):
        runs[fsdp] = tmp_path / ("fsdp" if fsdp else "ddp")
        _torchrun(tmp_path, data, runs[fsdp], "--preset", "tiny_time",
                  *[a for s in sets + [f"train.fsdp={str(fsdp).lower()}"] for a in ("--set", s)])
    _assert_close_runs(runs[False], runs[True])
    saved = load_config(latest_checkpoint(runs[True])).hybrid
    assert (saved.select, saved.layers, saved.fraction) == ("fixed", [1], 0.5)


def test_sharded_ema_holds_no_full_copy_between_reads(tmp_path):
    """ShardedEMA (one gloo rank here): the full EMA module has no weights outside `read()`, and inside it holds
    exactly what the plain EMA of the same updates holds."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1),
                                         rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Denoiser(tiny_cfg(write_episodes(tmp_path / "data")))
        sharded = copy.deepcopy(model)
        plain, ema = EMA(model, 0.9), EMA(sharded, 0.9)
        plain_ph, sharded_ph = PostHocEMA(model, [0.1], 1), PostHocEMA(sharded, [0.1], 1)  # as the trainer: before
        sharding.shard_model(sharded, torch.device("cpu"), 1)
        ema = sharding.ShardedEMA(ema, sharded)
        assert all(p.numel() == 0 for p in ema.model.parameters())
        with torch.no_grad():
            for p, q in zip(model.parameters(), sharded.parameters()):
                p.add_(1.0)
                q.add_(1.0)  # a DTensor: its local slice moves
        plain.update(model, step=5)
        ema.update(sharded, step=5)
        with ema.read() as full:
            assert full is ema.model
            for (name, a), b in zip(plain.model.named_parameters(), full.parameters()):
                assert torch.equal(a, b), name
            assert any((a - p).abs().max() > 0.1 for a, p in zip(full.parameters(), model.parameters()))
        assert all(p.numel() == 0 for p in ema.model.parameters())
        with pytest.raises(RuntimeError), ema.read():  # a failed read frees it too
            raise RuntimeError("boom")
        assert all(p.numel() == 0 for p in ema.model.parameters())
        # post-hoc EMA (train.ema_posthoc): sharded power EMAs keep their own β(t) and write the plain one's snapshots
        sharded_ph.shard(sharded)
        for step in (1, 2, 3):
            with torch.no_grad():
                for p, q in zip(model.parameters(), sharded.parameters()):
                    p.add_(0.5)
                    q.add_(0.5)
            plain_ph.update(model, step)
            sharded_ph.update(sharded, step)
        plain_ph.save(tmp_path / "plain", 3, is_main=True)
        sharded_ph.save(tmp_path / "sharded", 3, is_main=True)
        a, b = (load_file(str(snapshot_path(tmp_path / r, 0.1, 3))) for r in ("plain", "sharded"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert all(p.numel() == 0 for p in sharded_ph.emas[0].model.parameters())
    finally:
        torch.distributed.destroy_process_group()
