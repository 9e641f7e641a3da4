"""DDP with every memory structure x compressor (2 gloo ranks on the CPU), and a rank that dies or hangs.

Ranks are plain processes with RANK / WORLD_SIZE / MASTER_ADDR set (what torchrun sets), so a test can
kill one of them and watch what the other does. Models are tiny (dim 32, one block, 16 px) and runs take
two steps, so the whole matrix is one pair of processes.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_ddp import RECORD_WRITES
from test_malformed_inputs import TINY, write_data

from arvdm.config import apply_overrides, get_preset
from arvdm.training.objective import diffusion_forcing_loss
from arvdm.training.trainer import Trainer
from data.dataset import ClipDataset

REPO = Path(__file__).resolve().parents[1]
STRUCTURES = ("prepend", "channel_concat", "cross_attention")
COMPRESSORS = ("none", "joint", "modulated")
MATRIX = [[f"memory.structure={s}", f"memory.compressor={c}", f"memory.budget={0 if c == 'none' else 1}"]
          for s, c in itertools.product(STRUCTURES, COMPRESSORS)]
FSDP_MATRIX = [m + ["train.fsdp=true"] for m in MATRIX]  # the same under FSDP (arvdm.training.sharding)

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

# Both ranks train every configuration of the matrix for two steps and all-gather their flattened weights (under
# FSDP each rank's shards are gathered first).
# Every function that writes run outputs first notes which rank called it (one file per rank).
MATRIX_WORKER = RECORD_WRITES + textwrap.dedent("""
    import gc, json
    import torch, torch.distributed as dist
    from arvdm.config import apply_overrides, get_preset
    from arvdm.training.distributed import cleanup_distributed, setup_distributed
    from arvdm.training.sharding import full_tensor

    torch.set_num_threads(1)
    info = setup_distributed("cpu", timeout_s=120)
    base, matrix, out = json.loads(os.environ["BASE"]), json.loads(os.environ["MATRIX"]), os.environ["OUT"]
    results = []
    for i, extra in enumerate(matrix):
        cfg = apply_overrides(get_preset("tiny_time"), base + extra).validate()
        trainer = T.Trainer(cfg, os.path.join(out, f"run{i}"), dist_info=info)
        weights = lambda: torch.cat([full_tensor(p.detach()).flatten() for p in trainer.model.parameters()])
        start = weights()
        trainer.fit()
        trainer.close()
        flat = weights()
        both = [torch.empty_like(flat) for _ in range(info.world_size)]
        dist.all_gather(both, flat)
        results.append({"config": extra, "identical": bool(torch.equal(both[0], both[1])),
                        "moved": float((flat - start).abs().max())})
    cleanup_distributed()
    # a DDP wrapper left alive holds the freed group until interpreter shutdown, where gloo can abort
    ddp_alive = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    if info.is_main:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump({"matrix": results, "ddp_alive": ddp_alive}, f)
""")

# train.py's main() in each rank; rank DIE_RANK kills (SIGKILL) or freezes (SIGSTOP) itself at step DIE_AT.
DYING_WORKER = textwrap.dedent("""
    import os, signal, sys
    import arvdm.training.trainer as T

    step = T.Trainer.train_step
    def train_step(self, batch):
        if self.dist.rank == int(os.environ["DIE_RANK"]) and self.step == int(os.environ["DIE_AT"]):
            os.kill(os.getpid(), getattr(signal, os.environ["DIE_SIGNAL"]))
        return step(self, batch)
    T.Trainer.train_step = train_step
    sys.path.insert(0, os.environ["REPO"])
    import train
    sys.exit(train.main(sys.argv[1:]))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, args: list[str], env: dict[str, str], world: int = 2) -> list[subprocess.Popen]:
    """`world` ranks of `script`, as torchrun would start them on one node."""
    port = str(free_port())
    base = dict(os.environ, **env, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                REPO=str(REPO), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    return [subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
            for r in range(world)]


def base_config(data: Path) -> list[str]:
    return TINY + [f"data.path={data}", "train.max_steps=2", "train.ckpt_every=2", "train.log_every=1"]


def test_every_structure_and_compressor_uses_all_its_parameters(tmp_path):
    """DDP runs with find_unused_parameters=False, which needs a gradient for every parameter."""
    video, actions = torch.rand(2, 6, 3, 16, 16) * 2 - 1, torch.randint(0, 6, (2, 6))
    for extra in MATRIX:
        cfg = apply_overrides(get_preset("tiny_time"), base_config(tmp_path) + extra).validate()
        from arvdm.model.denoiser import Denoiser
        from arvdm.model.diffusion import PerFrameDiffusion

        model = Denoiser(cfg)
        total, _ = diffusion_forcing_loss(model, PerFrameDiffusion(cfg.diffusion), video, actions, 2, 100,
                                          torch.Generator().manual_seed(0))
        total.backward()
        unused = [n for n, p in model.named_parameters() if p.grad is None]
        assert not unused, f"{extra}: no gradient for {unused}"


def test_a_parameter_without_gradient_is_named_on_the_first_step(tmp_path):
    data = write_data(tmp_path / "data")
    cfg = apply_overrides(get_preset("tiny_time"), base_config(data)).validate()
    trainer = Trainer(cfg, tmp_path / "run", device="cpu")
    trainer.model.register_parameter("orphan", torch.nn.Parameter(torch.zeros(3)))
    from arvdm.training.loader import TrainingError
    with pytest.raises(TrainingError, match="orphan.*train.find_unused_parameters=true"):
        trainer.fit()


@pytest.mark.slow  # two processes training 9 tiny configurations under DDP and FSDP: ~2 min on a loaded 2-core CPU
def test_ddp_every_structure_and_compressor_keeps_ranks_identical(tmp_path):
    data = write_data(tmp_path / "data", n=3)
    ClipDataset(data / "training", 6)  # build the episode index once, before two ranks race to write it
    ClipDataset(data / "validation", 6)
    (tmp_path / "writes").mkdir()
    script = tmp_path / "matrix.py"
    script.write_text(MATRIX_WORKER)
    procs = launch(script, [], {"BASE": json.dumps(base_config(data)), "MATRIX": json.dumps(MATRIX + FSDP_MATRIX),
                                "OUT": str(tmp_path / "out"), "WRITES_DIR": str(tmp_path / "writes")})
    outputs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)

    written = json.loads((tmp_path / "out/results.json").read_text())
    assert written["ddp_alive"] == 0, "a DDP wrapper outlived cleanup_distributed (Trainer.close not called)"
    results = written["matrix"]
    assert [r["config"] for r in results] == MATRIX + FSDP_MATRIX
    for r in results:
        assert r["identical"], f"{r['config']}: ranks' weights differ after 2 DDP steps"
        assert r["moved"] > 0, f"{r['config']}: the weights did not change"
    # Only rank 0 wrote: one log and one checkpoint (step 2) per configuration.
    assert sorted(p.name for p in (tmp_path / "writes").iterdir()) == ["rank0"]
    assert sorted((tmp_path / "writes/rank0").read_text().split()) == ["checkpoint"] * 18 + ["log"] * 18
    for i in range(len(MATRIX) * 2):
        assert sorted(p.name for p in (tmp_path / f"out/run{i}/checkpoints").iterdir()) == ["step_0000002"]
    # FSDP trains every structure and compressor as DDP does (float rounding apart), into the same full checkpoint
    for i, config in enumerate(MATRIX):
        ddp, fsdp = (load_file(str(tmp_path / f"out/run{j}/checkpoints/step_0000002/model.safetensors"))
                     for j in (i, i + len(MATRIX)))
        assert ddp.keys() == fsdp.keys()
        for k in ddp:
            torch.testing.assert_close(fsdp[k], ddp[k], rtol=0, atol=1e-5, msg=f"{config} {k}")


@pytest.mark.slow  # two processes; the frozen case waits out a 5 s process-group timeout
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_frozen_rank_makes_the_other_exit_with_a_message(tmp_path, how):
    data = write_data(tmp_path / "data", n=3)
    ClipDataset(data / "training", 6)
    ClipDataset(data / "validation", 6)
    script = tmp_path / "dying.py"
    script.write_text(DYING_WORKER)
    overrides = base_config(data) + ["train.max_steps=50", "train.ckpt_every=2", "train.dist_timeout_s=5"]
    args = ["--preset", "tiny_time", "--data", str(data), "--out", str(tmp_path / "run"), "--device", "cpu",
            *[a for o in overrides for a in ("--set", o)]]
    procs = launch(script, args, {"DIE_RANK": "1", "DIE_AT": "3", "DIE_SIGNAL": how})
    try:
        _, err = procs[0].communicate(timeout=300)  # a hang fails here instead of stalling the suite
    finally:
        procs[1].kill()  # SIGKILL also ends a stopped process
        procs[1].communicate()
    assert procs[0].returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    message = err[err.index("train.py: error: rank 0 of 2 lost the other ranks"):].splitlines()[0]
    assert "--resume" in message and ("timeout" in message.lower() or "timed out" in message.lower()
                                      if how == "SIGSTOP" else True), message
    # The run is resumable: the checkpoint before the failure is complete.
    assert (tmp_path / "run/checkpoints/step_0000002/model.safetensors").is_file()
