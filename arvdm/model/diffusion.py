"""Per-frame Gaussian diffusion: every frame of a clip carries its own integer noise level.

Diffusers' schedulers step a whole batch from one scalar timestep; an auto-regressive video sampler moves
every window frame from its own level ``a`` to its own level ``b`` (a row of a scheduling matrix to the
next). The noise tables come from ``diffusers.DDPMScheduler`` (no hand-written betas); the transition is
written once here and agrees with diffusers' ``DDIMScheduler.step`` / ``DDPMScheduler.step`` when all
frames share a level (``tests/test_diffusion.py``).

Levels: ``0..K`` with ``K = cfg.num_levels``; level ``k >= 1`` is diffusers timestep ``k − 1`` and level 0
is the clean frame (ᾱ = 1). Levels are ``(B, T)`` int64 and broadcast over the trailing ``(C, H, W)``;
any levels shape that is a prefix of the sample's shape works (e.g. ``(B,)`` for images).

Parameterisation: v-prediction (Salimans & Ho, "Progressive Distillation", 2022, Sec. 4 / App. D):
``x_t = √ᾱ x0 + √(1−ᾱ) ε`` and ``v = √ᾱ ε − √(1−ᾱ) x0``, hence ``x0 = √ᾱ x_t − √(1−ᾱ) v`` and
``ε = √(1−ᾱ) x_t + √ᾱ v`` — no division, so the pure-noise level (ᾱ ≈ 0) is safe.
"""

from __future__ import annotations

import torch
from diffusers import DDPMScheduler

from arvdm.checks import value_checks_enabled
from arvdm.config import DiffusionConfig
from arvdm.setting_checks import check_eta

__all__ = ["PerFrameDiffusion"]


class PerFrameDiffusion:
    """Noise tables of a diffusers ``DDPMScheduler`` and per-frame forward/reverse transitions.

    Args:
        cfg: ``DiffusionConfig`` (``num_levels`` K, ``beta_schedule``; ``prediction_type`` must be
            ``"v_prediction"``).
        clip_x0: clamp the predicted clean frame to [-1, 1] before a transition (diffusers'
            ``clip_sample``). Off by default, which is what the diffusers equivalence tests use.

    Attributes:
        scheduler: the ``DDPMScheduler`` whose ``alphas_cumprod`` define the levels.
        alphas_bar: float64 (K+1,) table: ``alphas_bar[0] = 1``, ``alphas_bar[k] = alphas_cumprod[k−1]``.
    """

    def __init__(self, cfg: DiffusionConfig, *, clip_x0: bool = False):
        if cfg.prediction_type != "v_prediction":
            raise ValueError(f"PerFrameDiffusion supports prediction_type='v_prediction' only, "
                             f"got {cfg.prediction_type!r}")
        self.cfg = cfg
        self.num_levels = int(cfg.num_levels)
        self.clip_x0 = bool(clip_x0)
        self.scheduler = DDPMScheduler(num_train_timesteps=self.num_levels, beta_schedule=cfg.beta_schedule,
                                       prediction_type="v_prediction", clip_sample=False)
        # Level 0 is the clean frame; level k >= 1 is diffusers timestep k - 1. Float64 so that coefficient
        # arithmetic (1 - ᾱ, ratios) adds no error beyond diffusers' own float32 table.
        self.alphas_bar = torch.cat([torch.ones(1, dtype=torch.float64),
                                     self.scheduler.alphas_cumprod.to(torch.float64)])  # (K+1,)
        self._tables: dict[torch.device, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"PerFrameDiffusion(num_levels={self.num_levels}, beta_schedule={self.cfg.beta_schedule!r}, "
                f"clip_x0={self.clip_x0})")

    # -- tables ---------------------------------------------------------------------------------------
    def timesteps(self, levels: torch.Tensor) -> torch.Tensor:
        """Diffusers timesteps of ``levels`` (k − 1; −1 for the clean level 0)."""
        return self._check_levels(levels) - 1

    def alpha_bar(self, levels: torch.Tensor) -> torch.Tensor:
        """ᾱ of every level, float64, same shape as ``levels`` (1 at level 0, ≈ 0 at level K)."""
        levels = self._check_levels(levels)
        return self._table(levels.device)[levels]

    def _table(self, device: torch.device) -> torch.Tensor:
        if device not in self._tables:  # one copy per device, not one transfer per call
            self._tables[device] = self.alphas_bar.to(device)
        return self._tables[device]

    def _check_levels(self, levels: torch.Tensor) -> torch.Tensor:
        if not isinstance(levels, torch.Tensor):
            levels = torch.as_tensor(levels)
        if levels.dtype.is_floating_point or levels.dtype == torch.bool:
            raise TypeError(f"noise levels must be an integer tensor, got dtype {levels.dtype}")
        levels = levels.long()
        # A range check reads values back to the host: a device sync on a GPU (see arvdm.checks).
        if levels.numel() and value_checks_enabled(levels) and \
                (int(levels.min()) < 0 or int(levels.max()) > self.num_levels):
            raise ValueError(f"noise levels must lie in 0..K={self.num_levels}; got min {int(levels.min())}, "
                             f"max {int(levels.max())}")
        return levels

    def _coef(self, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Cast a per-frame coefficient (levels' shape) to ``like``'s dtype and append singleton dims so it
        broadcasts over the trailing sample dims: (B, T) -> (B, T, 1, 1, 1) for like (B, T, C, H, W)."""
        if values.shape != like.shape[:values.ndim]:
            raise ValueError(f"levels of shape {tuple(values.shape)} do not match the leading dims of a sample "
                             f"of shape {tuple(like.shape)}")
        return values.to(like.dtype).reshape(values.shape + (1,) * (like.ndim - values.ndim))

    # -- forward process and parameterisation -------------------------------------------------------------
    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """q(x_t | x0): ``√ᾱ x0 + √(1−ᾱ) ε`` per frame (Ho et al. 2020, eq. 4). Level 0 returns x0."""
        ab = self.alpha_bar(levels)
        return self._coef(ab.sqrt(), x0) * x0 + self._coef((1 - ab).sqrt(), x0) * noise

    def v_target(self, x0: torch.Tensor, noise: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """The v-prediction target ``v = √ᾱ ε − √(1−ᾱ) x0`` (Salimans & Ho 2022, eq. for v in Sec. 4)."""
        ab = self.alpha_bar(levels)
        return self._coef(ab.sqrt(), x0) * noise - self._coef((1 - ab).sqrt(), x0) * x0

    def pred_x0(self, x_t: torch.Tensor, v: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """Clean frame from a v-prediction: ``x0 = √ᾱ x_t − √(1−ᾱ) v`` (Salimans & Ho 2022, App. D)."""
        ab = self.alpha_bar(levels)
        return self._coef(ab.sqrt(), x_t) * x_t - self._coef((1 - ab).sqrt(), x_t) * v

    def pred_eps(self, x_t: torch.Tensor, v: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """Noise from a v-prediction: ``ε = √(1−ᾱ) x_t + √ᾱ v`` (Salimans & Ho 2022, App. D)."""
        ab = self.alpha_bar(levels)
        return self._coef((1 - ab).sqrt(), x_t) * x_t + self._coef(ab.sqrt(), x_t) * v

    def snr(self, levels: torch.Tensor) -> torch.Tensor:
        """Signal-to-noise ratio ``ᾱ / (1−ᾱ)`` per level, float64 (inf at the clean level 0)."""
        ab = self.alpha_bar(levels)
        return ab / (1 - ab)

    def loss_weight(self, levels: torch.Tensor, kind: str = "uniform", gamma: float = 5.0) -> torch.Tensor:
        """Per-frame weight of the v-MSE, float32, levels' shape.

        ``uniform``: 1. ``min_snr``: ``min(1, γ / (1 + SNR))`` — the v-loss equals ``(1 + SNR)`` times the
        x0-loss, so this caps the x0-weight at γ (Hang et al. 2023, "Min-SNR weighting", Eq. 8, with the
        +1 of the v-parameterisation): low-noise levels, which a rollout barely needs, stop dominating
        and the high-noise levels where every new frame starts keep weight 1.
        """
        if kind == "uniform":
            return torch.ones(levels.shape, dtype=torch.float32, device=levels.device)
        if kind != "min_snr":
            raise ValueError(f"unknown loss weight {kind!r}; use uniform or min_snr")
        return (gamma / (1 + self.snr(levels))).clamp(max=1.0).float()

    # -- reverse process ----------------------------------------------------------------------------------
    def transition(self, x_t: torch.Tensor, v: torch.Tensor, from_levels: torch.Tensor, to_levels: torch.Tensor,
                   eta: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Gaussian p(x_b | x_a) of every frame from level a = ``from_levels`` to level b = ``to_levels``.

        DDIM with stochasticity ``eta`` (Song et al. 2021, eq. 12, with σ from eq. 16):

            σ    = eta · √((1−ᾱ_b)/(1−ᾱ_a)) · √(1 − ᾱ_a/ᾱ_b)
            mean = √ᾱ_b · x0 + √(1 − ᾱ_b − σ²) · ε

        with x0, ε from the v-prediction. ``eta = 0`` is deterministic DDIM; ``eta = 1`` is the DDPM
        posterior q(x_b | x_a, x0) (for b = a − 1 exactly DDPM's ancestral step, "fixed_small" variance).
        Frames with b = a stay exactly as they are (mean = x_t, σ = 0) — a schedule row may hold some frames
        still; b = 0 gives the predicted clean frame (σ = 0). Raises ValueError when some b > a or a level
        is outside 0..K — value checks, run on CPU tensors or under ``ARVDM_DEBUG_CHECKS=1`` (they would
        cost a host-device sync per call on a GPU; see :mod:`arvdm.checks`).

        Args:
            x_t, v: (B, T, C, H, W) window and the model's v-prediction for it.
            from_levels, to_levels: (B, T) int64 levels.
            eta: 0..1.

        Returns:
            ``(mean, sigma)``: mean (B, T, C, H, W); sigma (B, T, 1, 1, 1), broadcastable to the sample. A
            sample is ``mean + sigma * z`` with z ~ N(0, I) (see :meth:`step`; speculative decoding reuses it).
        """
        check_eta(eta, "eta")
        from_levels, to_levels = self._check_levels(from_levels), self._check_levels(to_levels)
        if from_levels.shape != to_levels.shape:
            raise ValueError(f"from_levels {tuple(from_levels.shape)} and to_levels {tuple(to_levels.shape)} "
                             "must have the same shape")
        up = to_levels > from_levels
        if value_checks_enabled(up) and up.any():  # a value check: see arvdm.checks
            idx = tuple(int(i) for i in up.nonzero()[0])
            raise ValueError(f"transition only denoises: to_levels{list(idx)} = {int(to_levels[idx])} > "
                             f"from_levels{list(idx)} = {int(from_levels[idx])}")
        table = self._table(from_levels.device)
        ab_a, ab_b = table[from_levels], table[to_levels]  # float64, (B, T); levels checked above
        # x0 and ε from the v-prediction (Salimans & Ho 2022, App. D), with ᾱ_a looked up once.
        sa, sa1 = self._coef(ab_a.sqrt(), x_t), self._coef((1 - ab_a).sqrt(), x_t)
        x0 = sa * x_t - sa1 * v
        eps = sa1 * x_t + sa * v  # from the raw v even when x0 is clipped, as diffusers' DDIM does
        if self.clip_x0:
            x0 = x0.clamp(-1.0, 1.0)
        moving = to_levels < from_levels
        # Eq. 16. Guard 1 − ᾱ_a = 0 (a = 0, then b = a = 0 too and the frame does not move).
        var = torch.where(moving, (1 - ab_b) / (1 - ab_a).clamp_min(1e-300) * (1 - ab_a / ab_b),
                          torch.zeros_like(ab_a))
        sigma = float(eta) * var.clamp_min(0).sqrt()  # (B, T) float64
        # Eq. 12: "predicted x0" + "direction pointing to x_t" (+ σ z, added by step()).
        dir_coef = (1 - ab_b - sigma**2).clamp_min(0).sqrt()
        mean = self._coef(ab_b.sqrt(), x_t) * x0 + self._coef(dir_coef, x_t) * eps
        # Frames that stay: exactly x_t (the formula would return x_t only up to rounding).
        mean = torch.where(moving.reshape(moving.shape + (1,) * (x_t.ndim - moving.ndim)), mean, x_t)
        return mean, self._coef(sigma, x_t)

    def step(self, x_t: torch.Tensor, v: torch.Tensor, from_levels: torch.Tensor, to_levels: torch.Tensor,
             eta: float = 0.0, generator: torch.Generator | None = None,
             noise: torch.Tensor | None = None) -> torch.Tensor:
        """Sample x_b = mean + σ·z of :meth:`transition`.

        ``z`` is ``noise`` when given (same shape as ``x_t``), else drawn from ``generator`` — only when
        ``eta > 0``, so deterministic DDIM consumes no random numbers.
        """
        mean, sigma = self.transition(x_t, v, from_levels, to_levels, eta)
        if noise is None:
            if float(eta) == 0.0:
                return mean
            noise = torch.randn(x_t.shape, generator=generator, device=x_t.device, dtype=x_t.dtype)
        elif noise.shape != x_t.shape:
            raise ValueError(f"noise of shape {tuple(noise.shape)} does not match x_t {tuple(x_t.shape)}")
        return mean + sigma * noise
