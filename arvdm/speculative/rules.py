"""Exact speculative sampling rules: accept a draft's sample or replace it by one from the target.

Generic: nothing here knows about the denoiser. Both rules are pure functions of the draws they are
given (``z``, ``u``), so a caller controls every random number and a test can feed hand-picked ones.

Gaussian rule (De Bortoli et al., "Accelerated Diffusion Models via Speculative Sampling", arXiv
2501.05370): target p = N(m_p, σ²), draft q = N(m_q, σ²) with the same per-element σ. The caller passes the
draft's and the target's σ separately and the rule refuses (:class:`SigmaMismatchError`) when they differ:
with different variances the reflection below is not a coupling of q and p (a caller passing the draft's
σ = 1.5 for a target N(0.5, 1) would get N(0.5, 1.5²)), and no exact rule for that case is implemented. The
draft sample is
y = m_q + σ·z. With Δ = (m_p − m_q)/σ over all elements of one sample,

    accept  when  log u ≤ ⟨z, Δ⟩ − ‖Δ‖²/2  (= log p(y)/q(y)),
    else    y' = m_p + σ·(z − 2⟨z, e⟩ e),  e = Δ/‖Δ‖   (reflection maximal coupling).

The output is distributed exactly as p; P(accept) = 1 − TV(p, q) = 2Φ(−‖Δ‖/2). Elements with σ = 0 are
deterministic: the sample is accepted only if the means agree there (else p and q are mutually singular
and the target's value is taken, with the reflection on the other elements).

Token rule (Leviathan et al. 2023; Chen et al. 2023): accept a drafted token x ~ q with probability
min(1, p(x)/q(x)), else resample from norm(max(0, p − q)).
"""

from __future__ import annotations

import torch

from arvdm.errors import ArvdmError

__all__ = ["gaussian_accept_or_reflect", "token_accept_or_resample", "gaussian_acceptance_probability",
           "SigmaMismatchError"]


class SigmaMismatchError(ArvdmError):
    """The Gaussian rule was given a draft and a target with different σ (it is exact only for equal σ)."""


def gaussian_accept_or_reflect(z: torch.Tensor, mean_draft: torch.Tensor, mean_target: torch.Tensor,
                               sigma_draft: torch.Tensor, sigma_target: torch.Tensor,
                               u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative Gaussian transition per row of the batch.

    Args:
        z: (batch, ...) the standard normal draw that made the draft sample ``mean_draft + sigma_draft * z``.
        mean_draft, mean_target: (batch, ...) means of q and p.
        sigma_draft, sigma_target: (batch, ...) or broadcastable to z (e.g. (B, T, 1, 1, 1)); >= 0, the σ of q
            and of p. They must be equal element for element (bit for bit: exactness is not approximate),
            else :class:`SigmaMismatchError`.
        u: (batch,) uniforms in [0, 1).

    Returns:
        ``(y, accepted)``: y with z's shape (the draft sample where accepted, the reflection where not);
        accepted a bool (batch,) tensor.
    """
    if mean_draft.shape != z.shape or mean_target.shape != z.shape:
        raise ValueError(f"z {tuple(z.shape)}, mean_draft {tuple(mean_draft.shape)} and mean_target "
                         f"{tuple(mean_target.shape)} must have the same shape")
    sigma = _sigma_of_both(sigma_draft, sigma_target, z)  # (batch, ...)
    b = z.shape[0]
    if u.shape != (b,):
        raise ValueError(f"u must have shape (batch,) = ({b},), got {tuple(u.shape)}")
    if (sigma < 0).any():
        raise ValueError("sigma must be >= 0")
    y_draft = mean_draft + sigma * z  # the draft sample, computed exactly as a plain step computes it

    # Float64 for the test statistic: ⟨z, Δ⟩ and ‖Δ‖² are sums over many elements.
    random = sigma > 0  # (batch, ...)
    s = torch.where(random, sigma, torch.ones_like(sigma)).double()
    delta = torch.where(random, (mean_target.double() - mean_draft.double()) / s, 0.0)  # Δ, 0 where σ = 0
    zd = torch.where(random, z.double(), 0.0)
    dims = tuple(range(1, z.ndim))
    delta_sq = (delta * delta).sum(dims) if dims else delta * delta  # (batch,) ‖Δ‖²
    z_dot = (zd * delta).sum(dims) if dims else zd * delta  # (batch,) ⟨z, Δ⟩
    # σ = 0 elements: accept only if the means agree bit for bit there.
    fixed_differ = (~random) & (mean_target != mean_draft)
    fixed_ok = ~(fixed_differ.flatten(1).any(1) if z.ndim > 1 else fixed_differ)  # (batch,)
    log_ratio = z_dot - 0.5 * delta_sq  # log p(y)/q(y)
    accepted = fixed_ok & (torch.log(u.double()) <= log_ratio)  # (batch,)

    # Reflection maximal coupling: y' = m_p + σ (z − 2⟨z, e⟩ e), e = Δ/‖Δ‖; with Δ = 0 (rejected only for a
    # σ = 0 mismatch) the reflection is the identity: y' = m_p + σ z, still a draw from p.
    norm = delta_sq.sqrt()  # (batch,)
    shape = (b,) + (1,) * (z.ndim - 1)
    e = delta / norm.clamp_min(1e-300).reshape(shape)  # (batch, ...)
    coef = torch.where(norm > 0, z_dot / norm.clamp_min(1e-300), 0.0).reshape(shape)  # ⟨z, e⟩
    z_reflected = (zd - 2 * coef * e).to(z.dtype)
    z_reflected = torch.where(random, z_reflected, z)  # untouched where σ = 0 (multiplied by 0 below)
    y_reflected = mean_target + sigma * z_reflected
    y = torch.where(accepted.reshape(shape), y_draft, y_reflected)
    return y, accepted


def _sigma_of_both(sigma_draft: torch.Tensor, sigma_target: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The one σ of draft and target, expanded to z's shape; SigmaMismatchError when they differ."""
    expanded = []
    for name, sigma in (("sigma_draft", sigma_draft), ("sigma_target", sigma_target)):
        try:
            sigma = sigma if isinstance(sigma, torch.Tensor) else torch.as_tensor(sigma, dtype=z.dtype, device=z.device)
            expanded.append(sigma.expand_as(z))  # (batch, ...)
        except RuntimeError as err:
            raise ValueError(f"{name} of shape {tuple(torch.as_tensor(sigma).shape)} does not broadcast to z "
                             f"{tuple(z.shape)}") from err
    sd, st = expanded
    if not torch.equal(sd.double(), st.double()):
        differ = sd.double() != st.double()
        i = tuple(int(v) for v in differ.nonzero()[0])
        raise SigmaMismatchError(
            f"sigma_draft and sigma_target differ at {int(differ.sum())} of {differ.numel()} elements (e.g. at "
            f"{i}: sigma_draft {float(sd[i]):.6g}, sigma_target {float(st[i]):.6g}): the accept-or-reflect rule "
            "samples the target exactly only when draft and target share sigma")
    return st


def gaussian_acceptance_probability(delta_norm: float | torch.Tensor) -> torch.Tensor:
    """P(accept) = 1 − TV(N(0, I), N(Δ, I)) = 2Φ(−‖Δ‖/2) for the Gaussian rule.

    Public API (docs/INTERFACES.md): the closed form a caller checks the observed acceptance of
    :func:`gaussian_accept_or_reflect` against (the rollout itself does not need it)."""
    d = torch.as_tensor(delta_norm, dtype=torch.float64)
    return torch.special.ndtr(-d / 2) * 2


def token_accept_or_resample(token: torch.Tensor, probs_draft: torch.Tensor, probs_target: torch.Tensor,
                             u: torch.Tensor, u_resample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token rule: keep a drafted token with probability min(1, p/q), else resample from norm(max(0, p − q)).

    Public API (DESIGN.md promises the token rule; docs/INTERFACES.md): for discrete drafts, e.g. a token
    model's next token. The video rollout uses the Gaussian rule only.

    Args:
        token: (batch,) int64 tokens drawn from ``probs_draft``.
        probs_draft, probs_target: (batch, V) probabilities q and p (rows sum to 1).
        u: (batch,) uniforms for the accept test.
        u_resample: (batch,) uniforms for the resample (inverse CDF of the residual).

    Returns:
        ``(token_out, accepted)``: (batch,) int64 and (batch,) bool. token_out ~ p exactly.
    """
    if probs_draft.shape != probs_target.shape or probs_draft.dim() != 2:
        raise ValueError(f"probs_draft {tuple(probs_draft.shape)} and probs_target {tuple(probs_target.shape)} "
                         "must both be (batch, V)")
    b = probs_draft.shape[0]
    for name, t in (("token", token), ("u", u), ("u_resample", u_resample)):
        if t.shape != (b,):
            raise ValueError(f"{name} must have shape (batch,) = ({b},), got {tuple(t.shape)}")
    q = probs_draft.gather(1, token[:, None].long())[:, 0]  # (batch,) q(x)
    p = probs_target.gather(1, token[:, None].long())[:, 0]  # (batch,) p(x)
    accepted = u * q <= p  # u ≤ p/q without dividing (q(x) > 0 for a drawn token)
    residual = (probs_target - probs_draft).clamp_min(0)  # (batch, V) max(0, p − q)
    total = residual.sum(1, keepdim=True)  # (batch, 1)
    # total = 0 only when p = q, where every token is accepted; fall back to p to stay well defined.
    residual = torch.where(total > 0, residual / total.clamp_min(1e-300), probs_target)
    cdf = residual.cumsum(1)  # (batch, V)
    resampled = torch.searchsorted(cdf, (u_resample * cdf[:, -1])[:, None].to(cdf.dtype), right=True)[:, 0]
    resampled = resampled.clamp_max(probs_target.shape[1] - 1)
    return torch.where(accepted, token.long(), resampled), accepted
