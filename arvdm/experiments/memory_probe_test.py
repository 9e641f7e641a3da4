"""The teacher-forced paired memory test: on frames only memory can supply, is memory chosen by pose used?

    python -m arvdm.experiments.memory_probe_test --run runs/tiny --data datasets/look_around_seed7 --stride 2

Free rollouts mix two things: what memory gives and how far the rollout has drifted before the agent comes back.
Here every generated window's past is the **ground truth** (teacher forcing), so nothing accumulates and any
difference between memory modes is memory alone. For each probe frame t of an episode, the window starting at t
is generated from the ground-truth frames before it (the chunked schedule, ``--steps`` calls from K to 0, the
run's eta) with the same weights and the **same noise** (one generator per probe, seeded by (seed, episode, t),
drawn in a batch-1 rollout's order, once, and reused by every mode), memory chosen:

    pose   the run's own choice: remembered frames nearest in pose to the window (memory.select=pose)
    time   the frames just before the recent ones
    other  by pose, from another episode (the next one that is long enough) at the same frame count
    none   only the recent frames

and frame t is scored against the ground truth (PSNR capped at PSNR_CAP, SSIM). References: **copy-last**
(frame t-1, which teacher forcing hands the model) and the **oracle** (the earlier frame beyond the last
``memory.length`` of highest PSNR: what a perfect memory could copy).

Probe sets (a probe frame belongs to one or more; each set is reported on its own):

    pixel          ``arvdm.evaluation.probes.memory_probes``: an earlier frame beyond the last memory.length frames
                   matches at >= 25 dB, none of those recent frames does (the definition sample.py reports)
    pixel_at_pose  the pixel probes whose matching earlier frame is at t's pose (a true revisit, not a look-alike)
    pose           the pixel definition by pose (position and heading within the revisit tolerances)
    second_turn    look-around episodes only: every frame of the second full turn (one event per episode)

Consecutive probe frames are one **event**; means are pooled over probes with 95% intervals from an event-level
bootstrap (``pooled_rate``), and the paired differences pose-time, pose-other, pose-none and pose-copy_last come
with the same intervals (``paired_difference``). ``--stride S`` keeps every S-th probe of each event (every event
keeps its first frame, so events are not lost). Probe windows are batched (``--batch`` windows per forward; the
memory of every window sits at the same canonical time positions, which RoPE's relative distances make
equivalent to the episode's own). Of each window only its first chunk (frame t's) is denoised: block-causal
attention lets it see memory and itself only, so it comes out as in the whole window (a test holds both to a
rollout), and the memory's keys/values are built once per window, as in a cached rollout. The past's last frame
counts as observed, as the ground truth is, so a ``copy_gate=observed`` run gates every probe window (as a
rollout's first window); ``--last-generated`` counts it as generated, so the gate stays off and the network runs as
it does after a rollout's first window, where revisits happen. Writes
``memory_probe_test.json`` into --out (default RUN/memory_probe_test/).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from arvdm.config import SamplingError
from arvdm.errors import USER_ERRORS
from arvdm.evaluation.metrics import PSNR_CAP, psnr_per_frame, ssim_per_frame
from arvdm.evaluation.probes import MIN_EVENTS, memory_probes, paired_difference, pooled_rate, psnr_matrix
from arvdm.evaluation.revisits import DEFAULT_HEADING_TOL, DEFAULT_POS_TOL, pose_match_matrix
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.model.state import RolloutState
from arvdm.pipeline.runs import load_for_inference
from arvdm.sample_settings import SampleSettings
from arvdm.schedules.matrix import ARSchedule
from arvdm.schedules.presets import get_schedule
from data.atomic import atomic_write_json
from data.dataset import list_episodes, resolve_split, to_float_video
from data.episodes import load_episode, read_turns
from memory import MemoryFrames, PoseBank

__all__ = ["MODES", "SETS", "TFProbe", "find_probe_sets", "generate_probe_frames", "keep_every", "load_episodes",
           "memory_probe_test", "probe_noise", "probe_seed", "reference_scores", "run_memory_probe_test",
           "summarise_set"]

MODES = ("pose", "time", "other", "none")
REFERENCES = ("copy_last", "oracle")
COMPARED = ("time", "other", "none", "copy_last")  # pose minus each
SETS = ("pixel", "pixel_at_pose", "pose", "second_turn")


@dataclass(frozen=True)
class TFProbe:
    """Frame ``t`` of episode ``e`` (an index into the loaded episodes), in event ``event`` of its set."""

    e: int
    t: int
    event: int


# --------------------------------------------------------------------------------------------------------
# episodes and probes (ground truth only)
# --------------------------------------------------------------------------------------------------------


def load_episodes(root: str | Path, n: int | None, size: int) -> list[dict[str, Any]]:
    """The first ``n`` episodes (all when None) of ``root`` (its training split if it has one): video (T, C, H, W)
    in [-1, 1], actions (T,), poses (T, 3), turns (J, 2). Every episode must have poses."""
    root = Path(root)
    if not root.is_dir():
        raise SamplingError(f"--data {root}: no such folder")
    split = resolve_split(root, "training") if (root / "training").is_dir() or (root / "train").is_dir() else root
    out = []
    for path in list_episodes(split)[:n]:
        ep = load_episode(path)
        if ep.pose is None:
            raise SamplingError(f"{path}: has no poses (a 'pose' array): memory chosen by pose cannot be tested")
        video = to_float_video(torch.from_numpy(np.array(ep.video)).permute(0, 3, 1, 2))  # (T, C, H, W)
        if video.shape[-1] != size or video.shape[-2] != size:
            raise SamplingError(f"{path}: frames are {tuple(video.shape[-2:])} px, the run was trained at {size} px")
        out.append({"video": video, "actions": torch.as_tensor(np.asarray(ep.actions)).long(),
                    "pose": torch.as_tensor(np.asarray(ep.pose)).float(), "turns": read_turns(path),
                    "path": str(path)})
    if len(out) < 2:
        raise SamplingError(f"{split}: needs at least 2 episodes with poses (the 'other' mode takes memory from "
                            f"another episode), found {len(out)}")
    return out


def _runs(flags: torch.Tensor, e: int, first_event: int) -> list[TFProbe]:
    """Probes at the True entries of flags (T,), consecutive frames sharing an event id from first_event on."""
    out, event, last = [], first_event - 1, None
    for t in flags.nonzero().flatten().tolist():
        event += 0 if last == t - 1 else 1
        last = t
        out.append(TFProbe(e, t, event))
    return out


def find_probe_sets(eps: list[dict[str, Any]], recent: int, stride: int = 1) -> dict[str, list[TFProbe]]:
    """The probe frames of each set (``SETS``, see the module docstring), events numbered over all episodes, then
    every ``stride``-th probe of each event kept (its first always)."""
    sets: dict[str, list[TFProbe]] = {name: [] for name in SETS}
    for e, ep in enumerate(eps):
        nxt = {k: (v[-1].event + 1 if v else 0) for k, v in sets.items()}
        pix = memory_probes(ep["video"], ep["pose"], recent, first_event=nxt["pixel"], b=e)
        sets["pixel"] += [TFProbe(e, p.t, p.event) for p in pix]
        sets["pixel_at_pose"] += [TFProbe(e, p.t, p.event) for p in pix if p.pose_match]
        t_len = ep["pose"].shape[0]
        gap = torch.arange(t_len)[:, None] - torch.arange(t_len)[None, :]  # (T, T): t - s
        match = pose_match_matrix(ep["pose"], DEFAULT_POS_TOL, DEFAULT_HEADING_TOL)  # (T, T)
        flags = (match & (gap > recent)).any(1) & ~(match & (gap >= 1) & (gap <= recent)).any(1)  # (T,)
        sets["pose"] += _runs(flags, e, nxt["pose"])
        if ep["turns"].shape[0] >= 2:  # look-around: the second turn, one event
            lo, hi = (int(v) for v in ep["turns"][1])
            sets["second_turn"] += [TFProbe(e, t, nxt["second_turn"]) for t in range(max(lo, recent + 1), hi)]
    return {name: keep_every(probes, stride) for name, probes in sets.items()}


def keep_every(probes: list, stride: int) -> list:
    """Every ``stride``-th probe of each event (probes with ``.t`` and ``.event``, sorted by t within an event), its
    first always kept, so no event is lost."""
    if stride <= 1:
        return list(probes)
    first: dict[int, int] = {}
    for p in probes:
        first.setdefault(p.event, p.t)
    return [p for p in probes if (p.t - first[p.event]) % stride == 0]


def _events(probes: list[TFProbe]) -> int:
    return len({p.event for p in probes})


def reference_scores(eps: list[dict[str, Any]], frames: list[tuple[int, int]], recent: int
                     ) -> dict[str, dict[str, np.ndarray]]:
    """Copy-last (frame t-1) and oracle (the earlier frame s < t - recent of highest PSNR, the latest on ties)
    PSNR (capped) and SSIM per (episode, t) in ``frames``: ``{"psnr": {"copy_last": (F,), "oracle": (F,)},
    "ssim": {...}}``."""
    psnr_rows = {e: psnr_matrix(eps[e]["video"]) for e in sorted({e for e, _ in frames})}  # (T, T) each
    copy_src, oracle_src = [], []
    for e, t in frames:
        row = psnr_rows[e][t, : t - recent]  # (t - recent,) the earlier frames beyond the recent ones
        oracle_src.append(eps[e]["video"][t - recent - 1 - int(row.flip(0).argmax())])  # latest on ties
        copy_src.append(eps[e]["video"][t - 1])
    real = torch.stack([eps[e]["video"][t] for e, t in frames])[:, None]  # (F, 1, C, H, W)
    out: dict[str, dict[str, np.ndarray]] = {"psnr": {}, "ssim": {}}
    for name, src in (("copy_last", copy_src), ("oracle", oracle_src)):
        fake = torch.stack(src)[:, None]  # (F, 1, C, H, W)
        out["psnr"][name] = psnr_per_frame(fake, real).clamp(max=PSNR_CAP)[:, 0].double().numpy()
        out["ssim"][name] = ssim_per_frame(fake, real)[:, 0].double().numpy()
    return out


# --------------------------------------------------------------------------------------------------------
# teacher-forced windows
# --------------------------------------------------------------------------------------------------------


def _other_episode(eps: list[dict[str, Any]], e: int, t: int) -> int:
    """The next episode after e (cyclically) that holds at least t frames: where `other` takes its memory from."""
    for step in range(1, len(eps)):
        o = (e + step) % len(eps)
        if eps[o]["video"].shape[0] >= t:
            return o
    raise SamplingError(f"{eps[e]['path']}: no other episode holds the {t} frames before probe frame {t}")


def _ahead(x: torch.Tensor, t: int, w: int) -> torch.Tensor:
    """x[t:t+w] along dim 0, the last row repeated past the episode's end (as a rollout repeats the last action)."""
    part = x[t : t + w]
    return torch.cat([part, part[-1:].expand(w - part.shape[0], *part.shape[1:])]) if part.shape[0] < w else part


def _window_memory(model, eps: list[dict[str, Any]], e: int, t: int, mode: str, w: int) -> MemoryFrames:
    """The memory (batch 1) a rollout's pose bank gives the window at frame t of episode e after committing the
    ground-truth frames [0, t), with selection ``mode``. The bank holds this episode and the `other` one."""
    mem_cfg = model.cfg.memory
    o = _other_episode(eps, e, t) if mode == "other" else e
    bank = PoseBank(mem_cfg.length, mem_cfg.pose_frames, mem_cfg.bank_size, mode)
    bank.append(torch.stack([eps[e]["video"][:t], eps[o]["video"][:t]]),  # (2, t, C, H, W)
                torch.stack([eps[e]["actions"][:t], eps[o]["actions"][:t]]),
                torch.stack([eps[e]["pose"][:t], eps[o]["pose"][:t]]))
    target = _ahead(eps[e]["pose"], t, w)[None].expand(2, w, 3)  # (2, w, 3)
    mem = bank.memory(target)  # sample 0 (`other` draws its chosen frames from sample 1)
    return MemoryFrames(mem.frames[:1], mem.actions[:1], poses=mem.poses[:1], ages=mem.ages[:1],
                        target_poses=mem.target_poses[:1], levels=mem.levels[:1])


def _stack_memory(mems: list[MemoryFrames], device: torch.device) -> MemoryFrames:
    """Memories (batch 1, m frames each) -> one batch at canonical positions 0..m-1 (the window starts at m)."""
    m = mems[0].frames.shape[1]

    def cat(field: str) -> torch.Tensor:
        return torch.cat([getattr(x, field) for x in mems]).to(device)

    return MemoryFrames(cat("frames"), cat("actions"), positions=torch.arange(m, device=device), poses=cat("poses"),
                        next_index=m, ages=cat("ages"), target_poses=cat("target_poses"), levels=cat("levels"))


class _GivenMemory:
    """Stands in for a rollout's bank in a `RolloutState`: every sample's memory is already chosen (each probe
    window's by its own PoseBank), so `memory()` hands it over as it is. The past is ground truth, so its last
    frame counts as observed (`last_observed`, what a copy_gate=observed model reads from a rollout's bank) unless
    `observed` is False: the gate then stays off, as in a rollout after its first window."""

    def __init__(self, memory: MemoryFrames, observed: bool = True):
        self.given, self.n_committed = memory, memory.window_start
        self.last_observed = observed

    def __len__(self) -> int:
        return self.given.frames.shape[1]

    def memory(self, target_poses: torch.Tensor | None = None) -> MemoryFrames:
        return self.given


def _state(model, mem: MemoryFrames, frames: int, observed: bool = True) -> RolloutState:
    """A cached-rollout state holding `mem` for a window of `frames` frames: the memory's K/V (or projection) are
    built once, by the same refresh a commit runs (cached == recomputed), instead of at every call."""
    state = model.init_state(mem.frames.shape[0])
    state.bank, state.target_poses = _GivenMemory(mem, observed), mem.target_poses
    model.refresh_memory(state)  # the denoiser's own memory build from state.bank (the step every commit ends with)
    state.target_poses = mem.target_poses[:, :frames]  # the generated frames' poses (the memory was chosen for w)
    return state


def _transitions(schedule: ARSchedule) -> list[tuple[np.ndarray, np.ndarray]]:
    """(levels from, levels to) of every call of the first window: the initialization stage, then one AR step."""
    rows = [schedule.init_matrix(), np.asarray(schedule.matrix)]
    return [(r[i], r[i + 1]) for r in rows for i in range(r.shape[0] - 1)]


def probe_seed(seed: int, e: int, t: int) -> int:
    """The seed of the generator of probe (episode e, frame t): a function of (seed, e, t) only."""
    return int(np.random.SeedSequence([seed, e, t]).generate_state(1)[0])


def probe_noise(seed: int, e: int, t: int, draws: int, shape: tuple[int, ...]) -> torch.Tensor:
    """(draws, *shape) standard normals from the probe's own generator, drawn in the order a batch-1 rollout draws
    them (the window's initial noise, then one draw per call when eta > 0)."""
    g = torch.Generator().manual_seed(probe_seed(seed, e, t))
    return torch.stack([torch.randn((1, *shape), generator=g)[0] for _ in range(draws)])


@torch.no_grad()
def _denoise(model, diffusion: PerFrameDiffusion, schedule: ARSchedule, state: RolloutState, actions: torch.Tensor,
             noise: torch.Tensor) -> torch.Tensor:
    """The window's first chunk (P, c, C, H, W) from pure noise to level 0, as a rollout's plain rows take it;
    actions (P, c), noise (P, draws, c, C, H, W). With block-causal attention the first chunk sees only memory and
    itself, so it comes out as in the whole window."""
    eta = diffusion.cfg.eta
    x = noise[:, 0]  # (P, c, C, H, W) at level K
    for i, (lv_from, lv_to) in enumerate(_transitions(schedule)):
        c = x.shape[1]
        lv_a = torch.from_numpy(np.array(lv_from[:c])).to(x.device).expand(x.shape[0], -1)  # (P, c)
        lv_b = torch.from_numpy(np.array(lv_to[:c])).to(x.device).expand(x.shape[0], -1)  # (P, c)
        v = model(x, lv_a, actions, state=state)  # (P, c, C, H, W)
        x = diffusion.step(x, v, lv_a, lv_b, eta, noise=noise[:, i + 1] if eta > 0 else None)
    return x


def generate_probe_frames(model, diffusion: PerFrameDiffusion, schedule: ARSchedule, eps: list[dict[str, Any]],
                          frames: list[tuple[int, int]], modes: tuple[str, ...] = MODES, batch: int = 32,
                          seed: int = 0, progress: bool = True, last_observed: bool = True) -> dict[str, torch.Tensor]:
    """The generated frame t (F, C, H, W) for every (episode, t) of ``frames`` under each memory mode: the window
    at t generated from the ground truth before it, ``batch`` windows per forward, the same noise in every mode.
    ``last_observed`` False: the past's last frame counts as generated (a copy_gate=observed model's gate off)."""
    w, c, device = schedule.window, model.frames_per_chunk, model.device  # frame t is in the first chunk
    draws = 1 + len(_transitions(schedule)) * (diffusion.cfg.eta > 0)
    shape = tuple(eps[frames[0][0]]["video"].shape[1:])  # (C, H, W)
    out = {mode: torch.empty(len(frames), *shape) for mode in modes}
    starts = range(0, len(frames), batch)
    bar = tqdm(total=len(starts) * len(modes), desc="teacher-forced windows", unit="batch", disable=not progress)
    for start in starts:
        chunk = frames[start : start + batch]
        noise = torch.stack([probe_noise(seed, e, t, draws, (w, *shape))[:, :c] for e, t in chunk]).to(device)
        actions = torch.stack([_ahead(eps[e]["actions"], t, c) for e, t in chunk]).to(device)  # (P, c)
        for mode in modes:
            mems = [_window_memory(model, eps, e, t, mode, w) for e, t in chunk]
            for m in sorted({x.frames.shape[1] for x in mems}):  # windows early in an episode remember fewer
                idx = [i for i, x in enumerate(mems) if x.frames.shape[1] == m]
                state = _state(model, _stack_memory([mems[i] for i in idx], device), c, last_observed)
                gen = _denoise(model, diffusion, schedule, state, actions[idx], noise[idx])  # (P', c, C, H, W)
                out[mode][[start + i for i in idx]] = gen[:, 0].float().cpu()  # frame t: the window's first
            bar.update(1)
    bar.close()
    return out


# --------------------------------------------------------------------------------------------------------
# the test and its report
# --------------------------------------------------------------------------------------------------------


def run_memory_probe_test(model, diffusion: PerFrameDiffusion, schedule: ARSchedule, eps: list[dict[str, Any]],
                          stride: int = 1, batch: int = 32, seed: int = 0, n_boot: int = 2000,
                          progress: bool = True, last_observed: bool = True) -> dict[str, Any]:
    """The test on loaded episodes with a pose-aware model (see the module docstring): probe sets, teacher-forced
    frames under every mode, references, and per set pooled means, paired differences and a verdict in words.
    ``last_observed`` False counts the past's last frame as generated (`generate_probe_frames`).

    Raises SamplingError when the pixel probes come in fewer than MIN_EVENTS events (checked before any window is
    generated)."""
    recent = int(model.cfg.memory.length)
    sets = find_probe_sets(eps, recent, stride)
    if _events(sets["pixel"]) < MIN_EVENTS:
        raise SamplingError(f"{len(sets['pixel'])} memory probes in {_events(sets['pixel'])} events over {len(eps)} "
                            f"episodes: fewer than {MIN_EVENTS} events, too few to measure memory (use more "
                            "episodes, or episodes that come back to places they saw)")
    frames = sorted({(p.e, p.t) for probes in sets.values() for p in probes})
    gen = generate_probe_frames(model, diffusion, schedule, eps, frames, MODES, batch, seed, progress, last_observed)
    real = torch.stack([eps[e]["video"][t] for e, t in frames])[:, None]  # (F, 1, C, H, W)
    scores = reference_scores(eps, frames, recent)
    for mode, fake in gen.items():
        scores["psnr"][mode] = psnr_per_frame(fake[:, None], real).clamp(max=PSNR_CAP)[:, 0].double().numpy()
        scores["ssim"][mode] = ssim_per_frame(fake[:, None], real)[:, 0].double().numpy()
    names = [*MODES, *REFERENCES]
    scores = {metric: {k: scores[metric][k] for k in names} for metric in ("psnr", "ssim")}  # modes first
    index = {key: i for i, key in enumerate(frames)}
    summary = {name: summarise_set(scores, probes, index, n_boot, seed) for name, probes in sets.items()}
    member = {name: {(p.e, p.t) for p in probes} for name, probes in sets.items()}
    per_probe = [{"episode": e, "path": eps[e]["path"], "t": t, "sets": [n for n in SETS if (e, t) in member[n]],
                  **{metric: {k: float(v[i]) for k, v in scores[metric].items()} for metric in scores}}
                 for i, (e, t) in enumerate(frames)]
    return {"episodes": len(eps), "stride": stride, "recent": recent, "window": schedule.window,
            "steps": schedule.num_steps, "seed": seed, "last_observed": last_observed, "sets": summary,
            "verdict": summary["pixel"]["message"], "probes": per_probe}


def summarise_set(scores: dict[str, dict[str, np.ndarray]], probes: list[TFProbe], index: dict[tuple[int, int], int],
                  n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """One probe set: per metric, each mode's and reference's pooled mean with an event-level interval, and the
    paired differences pose minus time / other / none / copy_last; the share of the oracle's gap closed; a verdict.
    A set with fewer than MIN_EVENTS events reports its counts and ``too_few`` only."""
    n_events = _events(probes)
    head = {"probes": len(probes), "events": n_events, "too_few": n_events < MIN_EVENTS}
    if head["too_few"]:
        return {**head, "message": f"{len(probes)} probes in {n_events} events: fewer than {MIN_EVENTS}, not read"}
    rows = np.array([index[(p.e, p.t)] for p in probes])
    ids = [p.event for p in probes]
    out: dict[str, Any] = dict(head)
    for metric, values in scores.items():
        out[metric] = {k: pooled_rate(v[rows], ids, n_boot, seed) for k, v in values.items()}
        out[f"paired_{metric}"] = {f"pose_minus_{k}": paired_difference(values["pose"][rows], values[k][rows], ids,
                                                                         n_boot, seed) for k in COMPARED}
    m = {k: r["mean"] for k, r in out["psnr"].items()}
    gap = m["oracle"] - m["copy_last"]
    out["pose_closes_oracle_gap"] = (m["pose"] - m["copy_last"]) / gap if gap > 0 else None
    out["memory_helps"] = all(out["paired_psnr"][f"pose_minus_{k}"]["lo"] > 0 for k in ("time", "other", "none"))
    out["message"] = _verdict(out)
    return out


def _verdict(s: dict[str, Any]) -> str:
    """The set's result in words: does memory chosen by pose give better frames than the other choices?"""
    d = s["paired_psnr"]
    parts = ", ".join(f"{d[f'pose_minus_{k}']['mean']:+.2f} dB vs {k} [95% {d[f'pose_minus_{k}']['lo']:+.2f}, "
                      f"{d[f'pose_minus_{k}']['hi']:+.2f}]" for k in COMPARED)
    closes = s["pose_closes_oracle_gap"]
    gap = "" if closes is None else f"; pose closes {closes:.0%} of the oracle's gap over copy-last"
    head = ("memory helps" if s["memory_helps"] else
            "memory does NOT help (pose is not above time, other and none with 95% confidence)")
    pose = s["psnr"]["pose"]["mean"]
    return f"{head}: {s['probes']} probes in {s['events']} events, pose {pose:.2f} dB: {parts}{gap}"


def memory_probe_test(run: str, data: str, episodes: int | None = None, stride: int = 1,
                      steps: int = SampleSettings.steps, seed: int = 0, batch: int = 32, device: str = "cpu",
                      n_boot: int = 2000, progress: bool = True, last_observed: bool = True) -> dict[str, Any]:
    """Load a pose-aware run and its episodes, then ``run_memory_probe_test`` (see the module docstring)."""
    for flag, value in (("--stride", stride), ("--steps", steps), ("--batch", batch), ("--episodes", episodes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SamplingError(f"{flag} must be an integer >= 1, got {value!r}")
    model, cfg = load_for_inference(run, use_ema=True, device=torch.device(device))
    if cfg.memory.select != "pose":
        raise SamplingError(f"{run}: trained with memory.select={cfg.memory.select}; the memory probe test compares "
                            "memory choices of a pose-aware run (memory.select=pose)")
    diffusion = PerFrameDiffusion(cfg.diffusion)
    schedule = get_schedule("chunked", cfg.train.window, cfg.diffusion.num_levels, steps)
    eps = load_episodes(data, episodes, cfg.model.image_size)
    result = run_memory_probe_test(model, diffusion, schedule, eps, stride, batch, seed, n_boot, progress,
                                   last_observed)
    return {"run": str(run), "data": str(data), **result}


def _line(result: dict[str, Any]) -> str:
    flag = "" if result["last_observed"] else ", its last frame counted as generated"
    lines = [f"{result['episodes']} episodes, stride {result['stride']}, teacher-forced (ground-truth past{flag}):"]
    for name, s in result["sets"].items():
        if s["too_few"]:
            lines.append(f"  {name}: {s['message']}")
            continue
        means = ", ".join(f"{k} {r['mean']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}]" for k, r in s["psnr"].items())
        ssim = ", ".join(f"{k} {r['mean']:.3f}" for k, r in s["ssim"].items())
        lines += [f"  {name}: PSNR {means}", f"  {name}: SSIM {ssim}", f"  {name}: {s['message']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a pose-aware run folder (memory.select=pose)")
    p.add_argument("--data", required=True, help="a folder of episodes with poses (its training split if any)")
    p.add_argument("--episodes", type=int, default=None, help="the first N episodes (default: all)")
    p.add_argument("--stride", type=int, default=1, help="keep every S-th probe of each event (default 1: all)")
    p.add_argument("--steps", type=int, default=SampleSettings.steps, help="denoising calls from K to 0")
    p.add_argument("--batch", type=int, default=32, help="probe windows per forward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="output folder (default RUN/memory_probe_test)")
    p.add_argument("--last-generated", action="store_true",
                   help="count the past's last frame as generated: a copy_gate=observed run's gate stays off, as "
                        "after a rollout's first window (default: observed, as the ground truth is)")
    args = p.parse_args(argv)
    try:
        result = memory_probe_test(args.run, args.data, args.episodes, args.stride, args.steps, args.seed,
                                   args.batch, args.device, last_observed=not args.last_generated)
        out = Path(args.out or Path(args.run) / "memory_probe_test")
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "memory_probe_test.json", result)
    except USER_ERRORS as err:
        print(f"memory_probe_test: error: {err}", file=sys.stderr)
        return 2
    print(_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
