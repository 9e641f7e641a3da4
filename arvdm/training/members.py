"""A run trained as M independent members (``train.members`` = M): what each member trains and where.

    from arvdm.training.members import member_plan
    for m in member_plan(cfg, "runs/tiny", resume=False):   # Member(index, cfg, folder, resume)
        train(m.cfg, m.folder, resume=m.resume)              # what train.py does, one member after another

Member 0 is the run folder itself and trains the run's config (``train.members`` = M, ``train.seed`` = s); member
k >= 1 trains in ``RUN/members/k`` (``arvdm.pipeline.runs.member_folder``) the same config with ``train.seed`` = s + k
and ``train.members`` = 1: an ordinary run of its own (its own initial weights, data order and noise), which
``sample.py --run RUN/members/k`` samples alone. Each trains ``train.max_steps`` steps, so M members cost M times
one. Sampling a run of M members (``sample.py --run RUN``) draws every frame with member 0 and averages the
members' level-K predictions into the anchor (``arvdm.pipeline.anchor.AnchorEnsemble``, as ``--anchor-runs``
does with other runs): the members' mean sets each frame's low frequencies (benchmarks/RESULTS.md, "two members").

A late fork (step F = ``train.member_fork`` x max_steps, B = ``train.member_fork_lr_back`` x max_steps; 0 = off): member
0 keeps its step-F checkpoint, and each member k >= 1 starts there (weights, EMA, optimizer, data position) instead of
from scratch, with seed s + k (its own noise and data order from step F on) and its lr schedule set B steps back
(arvdm.training.resume.Fork), and trains steps F+1..max_steps: M members cost one run plus (M - 1)(max_steps - F)
steps (benchmarks/RESULTS.md, "late fork").

Anchor members (``train.member_top_level_p`` p): a member k >= 1 is only ever asked for its level-K prediction (the
anchor's call), so members 1.. train with ``train.top_level_p`` = p: that share of their clips puts every window
frame at level K, the call they answer (tiny: p = 1, forked at step 875 without the lr set back; benchmarks/RESULTS.md,
"anchor members"). Such a member, sampled alone, has spent its last steps on that one call.

``--resume`` resumes every member that has a checkpoint (a finished one loads its checkpoint, checked as any
resume's, and stops at once) and starts the rest; without it a member folder that already holds checkpoints is
refused (a leftover of another run), as the run folder is. So a finished run grows by a member with ``--resume --set
train.members=M+1``: member M trains (forked as the run's others were) and ``record_members`` writes the new count
into member 0's newest checkpoint, whose config tells the sampler how many members join the anchor.
"""

from __future__ import annotations

import copy
import os
from typing import NamedTuple

from arvdm.config import Config
from arvdm.model.checkpoint import CONFIG_NAME, CheckpointError, checkpoint_dir, latest_checkpoint, load_config
from arvdm.pipeline.runs import member_folder
from arvdm.training.resume import Fork
from data.atomic import atomic_write

__all__ = ["Member", "member_config", "member_plan", "record_members"]


class Member(NamedTuple):
    """One member of a run: its index k, config, run folder, whether it resumes from a checkpoint of its own, and
    where it starts otherwise (train.member_fork; None: from scratch)."""

    index: int
    cfg: Config
    folder: str
    resume: bool
    fork: Fork | None = None


def member_config(cfg: Config, k: int) -> Config:
    """Member k's config: the run's for k = 0; a copy with ``train.seed`` + k, ``train.members`` = 1, no fork and
    ``train.top_level_p`` = ``train.member_top_level_p`` otherwise (a run of its own)."""
    if k == 0:
        return cfg
    out = copy.deepcopy(cfg)
    out.train.seed, out.train.members = cfg.train.seed + k, 1
    out.train.member_fork = out.train.member_fork_lr_back = 0.0
    out.train.top_level_p, out.train.member_top_level_p = cfg.train.member_top_level_p, 0.0
    return out


def member_plan(cfg: Config, run_dir: str | os.PathLike, resume: bool, only: int | None = None) -> list[Member]:
    """Every member of the run in ``run_dir`` (config ``cfg``), in training order, or member ``only`` alone (the
    ranks launched for it). ``resume``: train.py's --resume (member 0's checkpoint is checked by train.py itself).
    CheckpointError for a member folder that holds checkpoints while ``resume`` is off."""
    plan = []
    for k in range(cfg.train.members) if only is None else (only,):
        folder = member_folder(run_dir, k)
        ckpt = latest_checkpoint(folder)
        if k and ckpt is not None and not resume:
            raise CheckpointError(f"{folder} (member {k} of {run_dir}) already holds checkpoints (newest {ckpt.name}); "
                                  "pass --resume to continue the run or choose another --out")
        own, (step, back) = resume and ckpt is not None, cfg.train.fork_steps()
        fork = Fork(checkpoint_dir(run_dir, step), back) if k and step else None
        plan.append(Member(k, member_config(cfg, k), str(folder), own, None if own else fork))
    return plan


def record_members(run_dir: str | os.PathLike, members: int) -> str | None:
    """Make member 0's newest checkpoint in ``run_dir`` say the run has ``members`` members (``train.members``),
    after train.py has trained them all. Member 0's config is what ``sample.py --run`` reads to find members
    1..M-1 (``arvdm.pipeline.runs.member_folders``); a resume that changes ``train.members`` after member 0 has
    finished writes no checkpoint of member 0, so without this the sampler would not see the change. Only
    ``train.members`` is rewritten (atomically); the weights and every other setting stay as trained. Returns the
    checkpoint rewritten, or None when it already said so (or there is none)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None
    saved = load_config(ckpt)
    if saved.train.members == members:
        return None
    saved.train.members = members
    text = saved.validate().to_json()
    atomic_write(ckpt / CONFIG_NAME, lambda p: p.write_text(text))
    return str(ckpt)
