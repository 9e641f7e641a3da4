"""The model learns video: a briefly trained tiny denoiser beats the trivial predictors on an easy clip.

The clip is action-driven so that neither baseline can solve it: flat frames of one of two colours,
action 1 toggles the colour, action 0 keeps it. Copying the last frame is wrong whenever the action
toggles; the context mean is always half wrong. The model has to read the previous frame (temporal
attention, through the memory prefix) and its action (AdaLN / adaptive group norm) to be right.
Measured on the first generated frame, which a chunked rollout produces straight from clean memory.
"""

import math

import pytest
import torch

from arvdm.config import apply_overrides, get_preset
from arvdm.evaluation.baselines import baseline_frames
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.schedules.presets import get_schedule
from arvdm.training.objective import diffusion_forcing_loss

S, K = 16, 100
STEPS = 500
COLOURS = torch.tensor([[0.6, -0.4, -0.4], [-0.4, -0.2, 0.6]])


def toggle_clips(b: int, t: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, 3, S, S) flat frames and (B, T) actions: action 1 toggles the colour, action 0 keeps it."""
    acts = torch.randint(0, 2, (b, t), generator=g)
    which = (torch.randint(0, 2, (b, 1), generator=g) + acts.cumsum(1)) % 2  # (B, T) colour index
    return COLOURS[which][..., None, None].expand(b, t, 3, S, S).contiguous(), acts


@pytest.mark.slow
def test_briefly_trained_model_beats_copy_last_and_context_mean():
    cfg = apply_overrides(get_preset("tiny_time"), [
        "model.image_size=16", "model.unet_channels=[8,16]", "model.patch_size=2", "model.dim=32",
        "model.depth=1", "model.heads=2", "model.num_actions=2", f"diffusion.num_levels={K}",
        "memory.length=2", "train.window=2"])
    torch.manual_seed(0)
    model, diffusion = Denoiser(cfg), PerFrameDiffusion(cfg.diffusion)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Cosine decay to 0 and batches of 32: a constant lr with batches of 16 left the model stuck before the
    # action-colour interaction on some seeds and machines (1 of 4 seeds, and seed 0 on the CI machine).
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, STEPS) / STEPS)))
    data, noise = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    for _ in range(STEPS):  # ~80 s on a quiet 2-core CPU
        video, actions = toggle_clips(32, 4, data)
        total, count = diffusion_forcing_loss(model, diffusion, video, actions, 2, K, noise, weight="min_snr")
        opt.zero_grad()
        (total / count.clamp(min=1)).backward()
        opt.step()
        decay.step()

    model.eval()
    video, actions = toggle_clips(32, 4, torch.Generator().manual_seed(123))
    with torch.no_grad():
        fake = rollout(model, diffusion, get_schedule("chunked", 2, K, 10), video[:, :2], actions[:, :2],
                       actions[:, 2:], 1, eta=0.0, generator=torch.Generator().manual_seed(0), progress=False)
    truth = video[:, 2:3]
    mse = {"model": (fake - truth).pow(2).mean().item()}
    for kind in ("copy_last", "context_mean"):
        mse[kind] = (baseline_frames(video, 2, 1, kind) - truth).pow(2).mean().item()
    assert mse["copy_last"] > 0.1 and mse["context_mean"] > 0.1, mse  # the clip is not trivially solvable
    assert mse["model"] < 0.5 * min(mse["copy_last"], mse["context_mean"]), mse
