"""benchmarks/train_speed.py's profile: ops sorted into kinds, and a profiled step of a small Trainer whose
shares add up and whose costliest kind is one the model has (its convolutions or matmuls)."""

from __future__ import annotations

import re

import torch

from arvdm.config import apply_overrides, get_preset
from arvdm.training.loader import collate
from arvdm.training.trainer import Trainer
from benchmarks.train_speed import op_kind, profile_steps, synthetic_data


def test_op_kind_sorts_known_ops():
    assert op_kind("aten::convolution_backward") == "convolution"
    assert op_kind("aten::mkldnn_convolution") == "convolution"
    assert op_kind("aten::addmm") == "matmul" and op_kind("aten::mm") == "matmul"
    assert op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert op_kind("aten::native_group_norm_backward") == "normalisation"
    assert op_kind("aten::gelu") == "activation"
    assert op_kind("Optimizer.step#AdamW.step") == "optimizer"
    assert op_kind("aten::fill_") == "other"


def test_profile_of_a_small_step_adds_up(tmp_path):
    cfg = apply_overrides(get_preset("tiny"), ["model.image_size=16", "data.resize=16", "model.unet_channels=[8,16]",
                                               "model.dim=32", "model.heads=2", "train.batch_size=2",
                                               "train.bf16=false", "train.members=1", "train.cpu_ranks=1"])
    cfg.data.path = str(synthetic_data(tmp_path / "data", cfg, episodes=2))
    cfg.train.val_every = cfg.train.sample_every = 0
    trainer = Trainer(cfg.validate(), tmp_path / "run")
    loader = torch.utils.data.DataLoader(trainer.train_ds, batch_sampler=trainer.sampler, collate_fn=collate)
    batches = [next(iter(loader))]
    text = profile_steps(trainer, batches, steps=1, top=5)
    lines = text.splitlines()
    assert lines[0].startswith("  profile of 1 steps (CPU self time") and len(lines) == 1 + 5 + 1
    kinds = lines[-1].removeprefix("  by kind: ")
    shares = {k.strip(): int(v) for k, v in re.findall(r"([a-z /]+) (\d+)%", kinds)}
    assert abs(sum(shares.values()) - 100) <= len(shares)  # each share rounded to a whole percent
    assert max(shares, key=shares.get) in ("convolution", "matmul")
