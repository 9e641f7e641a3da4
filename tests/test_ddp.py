"""`torchrun --nproc_per_node 2` on the CPU (gloo): trains, ranks stay identical, only rank 0 writes."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_training import POSE, TINY, write_episodes

REPO = Path(__file__).resolve().parents[1]

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

# Worker preamble shared by the DDP tests: wraps every function that writes run outputs so that it first
# notes which rank called it (one file per rank in WRITES_DIR).
RECORD_WRITES = textwrap.dedent("""
    import os, sys
    import arvdm.training.log as L
    import arvdm.training.sample_video as V
    import arvdm.training.trainer as T

    def record(name, fn):
        def wrapper(*args, **kwargs):
            with open(os.path.join(os.environ["WRITES_DIR"], "rank" + os.environ["RANK"]), "a") as f:
                f.write(name + "\\n")
            return fn(*args, **kwargs)
        return wrapper

    T.save_checkpoint = record("checkpoint", T.save_checkpoint)
    L.RunLogger.__init__ = record("log", L.RunLogger.__init__)
""")

# Runs train.py's main() in each rank (sample videos recorded too); after fit() every rank writes its final
# weights to FINAL_DIR/rank<r>.safetensors.
LAUNCHER = RECORD_WRITES + textwrap.dedent("""
    import torch
    from safetensors.torch import save_file
    from arvdm.model.checkpoint import state_dict_for_safetensors

    V.write_side_by_side = record("sample", V.write_side_by_side)
    fit = T.Trainer.fit
    def fit_and_dump(self, *args, **kwargs):
        last = fit(self, *args, **kwargs)
        os.makedirs(os.environ["FINAL_DIR"], exist_ok=True)
        save_file(state_dict_for_safetensors(self.model),
                  os.path.join(os.environ["FINAL_DIR"], "rank" + str(self.dist.rank) + ".safetensors"))
        return last
    T.Trainer.fit = fit_and_dump
    sys.path.insert(0, os.environ["REPO"])
    import gc, train
    code = train.main(sys.argv[1:])
    # no DDP wrapper may outlive the process group: freed at interpreter shutdown, gloo can abort the rank
    alive = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    with open(os.path.join(os.environ["FINAL_DIR"], "ddp_alive_rank" + os.environ["RANK"]), "w") as f:
        f.write(str(alive))
    sys.exit(code)
""")


@pytest.mark.slow  # two processes importing torch and training: ~35 s on a 2-core CPU
# grad_accum 2: DDP's no_sync on the first micro-batch, one all-reduce; pose_dropout: memory dropped in most steps
# (the memory's own parameters then get no gradient in those steps)
@pytest.mark.parametrize("grad_accum,memory", [(1, "time"), (2, "time"), (1, "pose"), (1, "pose_dropout")])
def test_torchrun_two_cpu_ranks(tmp_path, grad_accum, memory):
    data = write_episodes(tmp_path / "data", n_train=6, poses=memory != "time")
    (tmp_path / "writes").mkdir()
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    extra = {"time": [], "pose": POSE, "pose_dropout": POSE + ["train.memory_dropout=0.9"]}[memory]
    sets = TINY + extra + ["train.members=1", "train.max_steps=4", "train.ckpt_every=2", "train.val_every=2",
                           "train.val_batches=2", "train.sample_every=4", f"train.grad_accum={grad_accum}"]
    overrides = [a for o in sets for a in ("--set", o)]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", REPO=str(REPO),
               WRITES_DIR=str(tmp_path / "writes"), FINAL_DIR=str(tmp_path / "final"),
               OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(launcher), "--preset", "tiny_time" if memory == "time" else "tiny", "--data", str(data), "--out",
           str(tmp_path / "run"), "--device", "cpu", *overrides]
    proc = subprocess.run(cmd, check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    # Both ranks end with the same weights, and they are the ones rank 0 checkpointed.
    r0, r1 = (load_file(str(tmp_path / "final" / f"rank{r}.safetensors")) for r in (0, 1))
    ckpt = load_file(str(tmp_path / "run/checkpoints/step_0000004/model.safetensors"))
    assert r0.keys() == r1.keys() == ckpt.keys()
    for k in r0:
        assert torch.equal(r0[k], r1[k]) and torch.equal(r0[k], ckpt[k]), k
    assert [(tmp_path / "final" / f"ddp_alive_rank{r}").read_text() for r in (0, 1)] == ["0", "0"]
    # Only rank 0 wrote: checkpoints at steps 2 and 4, one log, one sample video.
    assert sorted(p.name for p in (tmp_path / "writes").iterdir()) == ["rank0"]
    assert sorted((tmp_path / "writes/rank0").read_text().split()) == ["checkpoint", "checkpoint", "log", "sample"]
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert (tmp_path / "run/samples/step_0000004.mp4").stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "run/log.csv").read_text().splitlines()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    # The training state holds both ranks' noise generators, and they differ (each rank draws its own noise).
    state = torch.load(tmp_path / "run/checkpoints/step_0000004/state.pt", weights_only=True)
    assert len(state["rng"]) == 2 and not torch.equal(state["rng"][0]["noise"], state["rng"][1]["noise"])
    assert state["data"] == {"position": 4 * 2 * 2 * grad_accum, "dataset_len": state["data"]["dataset_len"],
                             "batch_size": 2, "world_size": 2}


@pytest.mark.slow  # two processes training two members: ~40 s on a 2-core CPU
def test_torchrun_trains_the_forked_member_in_the_same_process_group(tmp_path):
    """The tiny preset's two members (the second forked late) under torchrun: both in one process group (one made
    again for the second member hung the ranks at exit), the fork's checkpoint kept, the member's own weights."""
    data = write_episodes(tmp_path / "data", n_train=6, poses=True)
    sets = TINY + POSE + ["train.max_steps=4", "train.ckpt_every=2", "train.val_every=0", "train.sample_every=0"]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "train.py"), "--preset", "tiny", "--data", str(data), "--out", str(tmp_path / "run"),
           "--device", "cpu", *(a for s in sets for a in ("--set", s))]
    proc = subprocess.run(cmd, check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "run"
    # the fork at step round(5/6 x 4) = 3 is kept beside the newest; step 2 is pruned (keep_checkpoints=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000003", "step_0000004"]
    assert sorted(p.name for p in (run / "members/1/checkpoints").iterdir()) == ["step_0000004"]
    assert "forked from" in proc.stderr and "step_0000003 at step 3" in proc.stderr
    first, second = (load_file(str(r / "checkpoints/step_0000004/model.safetensors")) for r in (run, run / "members/1"))
    assert any(not torch.equal(first[k], second[k]) for k in first)
