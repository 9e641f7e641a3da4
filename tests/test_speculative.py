"""arvdm/speculative/rules.py: the Gaussian accept-or-reflect rule and the token rule are exact.

Statistical tests use fixed seeds and thresholds for a 1e-3 false-alarm rate overall (Bonferroni over the
tests of a case).
"""

import math

import pytest
import torch
from scipy import stats

from arvdm.speculative.rules import (
    SigmaMismatchError,
    gaussian_accept_or_reflect,
    gaussian_acceptance_probability,
    token_accept_or_resample,
)

ALPHA = 1e-3


def test_hand_case_1d():
    """m_q = 0, m_p = 1, σ = 1, z = 0.3: log p/q = 0.3 − 0.5 = −0.2, exp(−0.2) = 0.8187."""
    z, mq, mp, s = (torch.tensor([[0.3]], dtype=torch.float64) * 0 + v for v in (0.3, 0.0, 1.0, 1.0))
    y, acc = gaussian_accept_or_reflect(z, mq, mp, s, s, torch.tensor([0.8], dtype=torch.float64))
    assert acc.tolist() == [True] and y.item() == pytest.approx(0.3)
    y, acc = gaussian_accept_or_reflect(z, mq, mp, s, s, torch.tensor([0.9], dtype=torch.float64))
    assert acc.tolist() == [False] and y.item() == pytest.approx(0.7)  # 1 + (0.3 − 2·0.3)


def _case(d, delta_norm, n, seed):
    g = torch.Generator().manual_seed(seed)
    sigma = torch.rand(d, generator=g, dtype=torch.float64) + 0.5  # per-element σ in [0.5, 1.5]
    mq = torch.randn(d, generator=g, dtype=torch.float64)
    direction = torch.randn(d, generator=g, dtype=torch.float64)
    mp = mq + sigma * direction / direction.norm() * delta_norm  # ‖(m_p − m_q)/σ‖ = delta_norm
    z = torch.randn(n, d, generator=g, dtype=torch.float64)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    y, acc = gaussian_accept_or_reflect(z, mq.expand(n, d), mp.expand(n, d), sigma.expand(n, d), sigma, u)
    direct = mp + sigma * torch.randn(n, d, generator=g, dtype=torch.float64)  # direct samples of p
    return y, acc, direct, (mp, mq, sigma, direction / direction.norm(), z)


@pytest.mark.parametrize("d", [1, 8, 64])
@pytest.mark.parametrize("delta_norm", [0.1, 1.0, 3.0])
def test_output_is_target_distribution_and_acceptance_rate(d, delta_norm):
    n = 100_000
    y, acc, direct, (mp, mq, sigma, e, _) = _case(d, delta_norm, n, seed=d * 10 + int(delta_norm * 10))
    # acceptance within 4 standard errors of 2Φ(−‖Δ‖/2)
    p_acc = float(gaussian_acceptance_probability(delta_norm))
    se = math.sqrt(p_acc * (1 - p_acc) / n)
    assert abs(acc.double().mean().item() - p_acc) < 4 * se
    # two-sample KS tests against direct sampling from p on the projections that matter: along Δ (where the
    # reflection acts), along a fixed orthogonal direction, and the squared standardized norm
    std_y, std_d = (y - mp) / sigma, (direct - mp) / sigma  # (n, d)
    g = torch.Generator().manual_seed(1)
    r = torch.randn(d, generator=g, dtype=torch.float64)
    r = r - (r @ e) * e if d > 1 else r
    projections = [(std_y @ e, std_d @ e), ((y - mp) @ r, (direct - mp) @ r),
                   ((std_y**2).sum(1), (std_d**2).sum(1))]
    for a, b in projections:
        assert stats.ks_2samp(a.numpy(), b.numpy()).pvalue > ALPHA / len(projections)
    # the mean of the output matches m_p (4 standard errors per element, float64)
    assert ((y.mean(0) - mp).abs() / (sigma / math.sqrt(n)) < 5).all()


def test_reflection_preserves_orthogonal_part_and_rejects_are_reflections():
    y, acc, _, (mp, mq, sigma, e, z) = _case(8, 1.0, 2000, seed=3)
    assert torch.allclose(y[acc], (mq + sigma * z)[acc])  # accepted: the draft sample itself
    zr = (y[~acc] - mp) / sigma  # rejected: z reflected about the hyperplane ⟂ e
    assert torch.allclose(zr, z[~acc] - 2 * (z[~acc] @ e)[:, None] * e, atol=1e-10)
    assert (~acc).sum() > 100


def test_sigma_zero_elements_need_equal_means():
    z = torch.randn(3, 4, dtype=torch.float64)
    sigma = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64).expand(3, 4)
    mq = torch.zeros(3, 4, dtype=torch.float64)
    mp = mq.clone()
    mp[1, 0] = 0.5  # row 1 disagrees on the deterministic element
    u = torch.full((3,), 0.5, dtype=torch.float64)
    y, acc = gaussian_accept_or_reflect(z, mq, mp, sigma, sigma, u)
    assert acc.tolist() == [True, False, True]  # Δ = 0 on σ > 0: accepted unless the σ = 0 element differs
    assert y[1, 0] == 0.5  # the target's value on the deterministic element
    assert torch.equal(y[1, 1:], z[1, 1:])  # Δ = 0 elsewhere: the reflection is the identity
    assert torch.equal(y[0], mq[0] + sigma[0] * z[0])


def test_broadcast_sigma_and_bad_shapes():
    z = torch.randn(2, 3, 1, 2, 2)
    m = torch.zeros_like(z)
    one = torch.ones(2, 3, 1, 1, 1)
    y, acc = gaussian_accept_or_reflect(z, m, m, one, one, torch.rand(2))
    assert acc.all() and torch.equal(y, z)  # identical means: always accepted, y = m_q + σ z
    with pytest.raises(ValueError, match="u must have shape"):
        gaussian_accept_or_reflect(z, m, m, one, one, torch.rand(3))
    with pytest.raises(ValueError, match="sigma_draft of shape"):
        gaussian_accept_or_reflect(z, m, m, torch.ones(4, 1), one, torch.rand(2))
    with pytest.raises(ValueError, match="sigma_target of shape"):
        gaussian_accept_or_reflect(z, m, m, one, torch.ones(4, 1), torch.rand(2))


def test_differing_draft_and_target_sigma_refused():
    """Draft N(0, 1.5²), target N(0.5, 1): the rule has both σ and refuses, naming both, instead of sampling
    N(0.5, 1.5²) as the one-σ rule did when given the draft's σ (shown below: that law is detectably wrong)."""
    n = 20_000
    g = torch.Generator().manual_seed(5)
    z = torch.randn(n, 1, generator=g, dtype=torch.float64)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    mq, mp = torch.zeros(n, 1, dtype=torch.float64), torch.full((n, 1), 0.5, dtype=torch.float64)
    s_draft, s_target = torch.full((n, 1), 1.5, dtype=torch.float64), torch.ones(n, 1, dtype=torch.float64)
    with pytest.raises(SigmaMismatchError, match=r"sigma_draft 1\.5, sigma_target 1\b") as err:
        gaussian_accept_or_reflect(z, mq, mp, s_draft, s_target, u)
    assert isinstance(err.value, ValueError) and "differ at 20000 of 20000 elements" in str(err.value)
    # one element off by one ulp is refused too (exactness is not approximate)
    s_near = s_target.clone()
    s_near[7, 0] = torch.nextafter(s_near[7, 0], torch.tensor(2.0, dtype=torch.float64))
    with pytest.raises(SigmaMismatchError, match=r"differ at 1 of 20000 elements \(e\.g\. at \(7, 0\)"):
        gaussian_accept_or_reflect(z, mq, mp, s_near, s_target, u)
    # what the misuse gave: with the draft's σ in both places the output is N(0.5, 1.5²), not the target's
    y, _ = gaussian_accept_or_reflect(z, mq, mp, s_draft, s_draft, u)
    assert stats.kstest(((y - 0.5) / 1.5).flatten().numpy(), "norm").pvalue > ALPHA  # N(0.5, 1.5²)
    assert stats.kstest((y - 0.5).flatten().numpy(), "norm").pvalue < 1e-10  # not N(0.5, 1)
    # equal σ (the target's) on the same draws: the target law
    y, _ = gaussian_accept_or_reflect(z, mq, mp, s_target, s_target, u)
    assert stats.kstest((y - 0.5).flatten().numpy(), "norm").pvalue > ALPHA


@pytest.mark.parametrize("seed", [0, 1])
def test_token_rule_is_exact(seed):
    g = torch.Generator().manual_seed(seed)
    n, v = 100_000, 6
    p = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 1.5, 0)
    q = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 1.5, 0)
    tok = torch.multinomial(q, n, replacement=True, generator=g)
    out, acc = token_accept_or_resample(tok, q.expand(n, v), p.expand(n, v), torch.rand(n, generator=g,
                                        dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64))
    counts = torch.bincount(out, minlength=v).double()
    assert stats.chisquare(counts.numpy(), (p * n).numpy()).pvalue > ALPHA
    p_acc = float(torch.minimum(p, q).sum())  # 1 − TV(p, q)
    assert abs(acc.double().mean().item() - p_acc) < 4 * math.sqrt(p_acc * (1 - p_acc) / n)
    assert torch.equal(out[acc], tok[acc])


def test_token_rule_equal_distributions_accepts_all():
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    out, acc = token_accept_or_resample(torch.tensor([1, 0]), p, p, torch.tensor([0.999, 0.3]), torch.rand(2))
    assert acc.all() and out.tolist() == [1, 0]
