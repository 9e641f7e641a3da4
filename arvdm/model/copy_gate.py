"""model.copy_gate: a gate on the denoiser's clean frame that copies the last past frame (or it advected).

    cond, on = gate_on(model, cond, state, memory, last)          # copy_gate=observed: (B,) 1 on real last frames
    v, logit, x0_hat = copy_last(model, out, x, levels, source, on)
    v_hat = own_v(model, x, levels, x0_hat)                       # the network's v before the gate (training)

Functions of a `Denoiser` (arvdm/model/denoiser.py), which owns what they read: `sqrt_ab` / `sqrt_1m_ab` (the run's
noise schedule), `gate_per_frame` and, for copy_gate=observed, `gate_on_embed`.

copy_gate=observed gates only while the last frame is an observed one (a rollout's context; in training a random
`OBSERVED_GATE_SHARE` of the clips): a copied real frame is the best guess for a scene that stands still, a copied
generated frame carries the rollout's own errors forward. The network is told which of the two it is (a learned
vector added to the window's conditioning), so after the first window it is one trained without the gate.
"""

from __future__ import annotations

import torch

from arvdm.model.state import RolloutState
from memory import MemoryFrames

__all__ = ["COPY_GATE_BIAS", "OBSERVED_GATE_SHARE", "copy_last", "gate_on", "own_v"]

COPY_GATE_BIAS = -4.0  # the gate's logit offset, so a fresh model copies sigmoid(-4) = 1.8%
OBSERVED_GATE_SHARE = 0.5  # copy_gate=observed: share of training clips whose last frame counts as observed


def gate_on(model, cond: torch.Tensor, state: RolloutState | None, memory: MemoryFrames | None,
            last: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """copy_gate=observed: `on` (B,) is 1.0 where the last frame is an observed one (`MemoryFrames.last_observed`,
    None = observed; a rollout's state: its bank's newest frame was committed as context), else 0.0 (also without a
    last frame), and the window's conditioning `cond` (B,T,D) gets `on` · gate_on_embed. Every other model: `cond`
    as it is and None (the gate wherever a last frame is)."""
    if model.gate_on_embed is None:
        return cond, None
    b = cond.shape[0]
    flag = False if last is None else state.bank.last_observed if state is not None else memory.last_observed
    flag = True if flag is None else flag
    on = torch.as_tensor(flag, dtype=torch.float32, device=cond.device).expand(b)  # (B,)
    return cond + on[:, None, None] * model.gate_on_embed, on  # (B,T,D), (B,)


def copy_last(model, out: torch.Tensor, x: torch.Tensor, levels: torch.Tensor, last: torch.Tensor | None,
              on: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """v whose clean frame is the network's, gated per pixel (or per frame) towards the last frame (`last`
    (B,1,C,H,W), or (B,T,C,H,W): the last frame advected along each frame's actions).

    The decoder gives `out` = v̂ (B,T,C,H,W) and a logit z (B,T,1,H,W) (copy_gate=frame: its mean over the frame);
    with x̂0 = √ᾱ x − √(1−ᾱ) v̂ (Salimans & Ho 2022, App. D) and g = sigmoid(z + COPY_GATE_BIAS), the clean frame
    is x0 = x̂0 + g (last − x̂0) and the v returned is the one that gives it, v = v̂ + g (x̂0 − last) / √(1−ᾱ): a
    scene that stands still is a gate of 1, not a level-dependent mix of x and last to compute. Frames at level 0
    (which never move) and calls without a last frame (no memory) get v̂. Float32 (the division is large at low
    levels). `on` (B,) (copy_gate=observed, `gate_on`) multiplies g: 0 leaves v̂. Returns v, the gate's logit
    z + COPY_GATE_BIAS and x̂0 (None, None without a last frame)."""
    v_hat, logit = out[:, :, :-1], out[:, :, -1:]  # (B,T,C,H,W), (B,T,1,H,W)
    if last is None:
        return v_hat, None, None
    if model.gate_per_frame:  # one gate per frame: "the scene stands still", not "this pixel does"
        logit = logit.mean(dim=(-2, -1), keepdim=True)  # (B,T,1,1,1)
    v_hat32 = v_hat.float()
    s, s1 = model.sqrt_ab[levels], model.sqrt_1m_ab[levels]  # (B,T) each
    s, s1 = s[:, :, None, None, None], s1[:, :, None, None, None]  # (B,T,1,1,1)
    x0_hat = s * x.float() - s1 * v_hat32  # (B,T,C,H,W)
    logit = logit.float() + COPY_GATE_BIAS  # (B,T,1,H,W) or (B,T,1,1,1)
    gate = torch.sigmoid(logit)  # (B,T,1,H|1,W|1)
    if on is not None:
        gate = gate * on[:, None, None, None, None]
    v = v_hat32 + gate * (x0_hat - last.float()) / s1.clamp_min(1e-6)
    return torch.where(s1 > 0, v, v_hat32).to(out.dtype), logit, x0_hat  # (B,T,C,H,W), logit, x̂0


def own_v(model, x: torch.Tensor, levels: torch.Tensor, x0_hat: torch.Tensor) -> torch.Tensor:
    """The network's own v̂ (B,T,C,H,W) float32, before the gate, from the x̂0 `copy_last` returns: the inverse of
    x̂0 = √ᾱ x − √(1−ᾱ) v̂, v̂ = (√ᾱ x − x̂0) / √(1−ᾱ) (zero at level 0, where no frame is counted).
    train.copy_gate_detach takes the v-MSE on it, so the network trains as one without a gate."""
    s, s1 = model.sqrt_ab[levels], model.sqrt_1m_ab[levels]  # (B,T) each
    s, s1 = s[:, :, None, None, None], s1[:, :, None, None, None]  # (B,T,1,1,1)
    return torch.where(s1 > 0, (s * x.float() - x0_hat) / s1.clamp_min(1e-6), torch.zeros_like(x0_hat))
