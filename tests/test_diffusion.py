"""Per-frame diffusion against diffusers: tables, add_noise, velocity, DDIM / DDPM steps at a shared level."""

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler

from arvdm.config import DiffusionConfig
from arvdm.model.diffusion import PerFrameDiffusion

K = 1000
SCHEDULES = ["squaredcos_cap_v2", "sigmoid"]
TOL = {"rtol": 1e-5, "atol": 1e-5}


def make(beta_schedule, **kw):
    return PerFrameDiffusion(DiffusionConfig(num_levels=K, beta_schedule=beta_schedule), **kw)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ddim(beta_schedule, n_inference, clip=False):
    # DDIMScheduler has no "sigmoid" schedule: give it the DDPM scheduler's betas (the same table for both).
    betas = DDPMScheduler(num_train_timesteps=K, beta_schedule=beta_schedule).betas
    s = DDIMScheduler(num_train_timesteps=K, trained_betas=betas.numpy(), prediction_type="v_prediction",
                      set_alpha_to_one=True, clip_sample=clip)
    s.set_timesteps(n_inference)
    return s


@pytest.mark.parametrize("beta_schedule", SCHEDULES)
def test_alpha_bar_is_diffusers_table_shifted_by_one(beta_schedule):
    d = make(beta_schedule)
    ref = DDPMScheduler(num_train_timesteps=K, beta_schedule=beta_schedule).alphas_cumprod
    levels = torch.tensor([[0, 1, 2], [500, K - 1, K]])
    got = d.alpha_bar(levels)
    assert got.shape == (2, 3)
    assert got[0, 0] == 1.0  # level 0 is clean
    torch.testing.assert_close(got.flatten()[1:].float(), ref[levels.flatten()[1:] - 1], rtol=0, atol=0)
    assert d.timesteps(levels).tolist() == [[-1, 0, 1], [499, 998, 999]]


@pytest.mark.parametrize("beta_schedule", SCHEDULES)
def test_add_noise_and_velocity_match_diffusers(beta_schedule):
    d, ref = make(beta_schedule), DDPMScheduler(num_train_timesteps=K, beta_schedule=beta_schedule)
    x0, noise = rand(2, 3, 3, 4, 4, seed=1), rand(2, 3, 3, 4, 4, seed=2)
    levels = torch.tensor([[1, 400, K], [37, 999, 2]])  # (B, T): every frame its own level
    flat = lambda t: t.reshape(6, 3, 4, 4)
    want_xt = ref.add_noise(flat(x0), flat(noise), levels.flatten() - 1).reshape(x0.shape)
    want_v = ref.get_velocity(flat(x0), flat(noise), levels.flatten() - 1).reshape(x0.shape)
    torch.testing.assert_close(d.add_noise(x0, noise, levels), want_xt, **TOL)
    torch.testing.assert_close(d.v_target(x0, noise, levels), want_v, **TOL)
    # level 0 leaves the frame clean
    zero = torch.zeros(2, 3, dtype=torch.long)
    assert torch.equal(d.add_noise(x0, noise, zero), x0)


@pytest.mark.parametrize("beta_schedule", SCHEDULES)
def test_pred_x0_and_eps_invert_add_noise(beta_schedule):
    d = make(beta_schedule)
    x0, noise = rand(2, 4, 3, 4, 4, seed=3), rand(2, 4, 3, 4, 4, seed=4)
    levels = torch.tensor([[0, 1, 500, K], [K, 999, 250, 3]])
    x_t, v = d.add_noise(x0, noise, levels), d.v_target(x0, noise, levels)
    torch.testing.assert_close(d.pred_x0(x_t, v, levels), x0, **TOL)
    torch.testing.assert_close(d.pred_eps(x_t, v, levels)[:, 1:], noise[:, 1:], **TOL)  # ε is moot at level 0


@pytest.mark.parametrize("beta_schedule", SCHEDULES)
@pytest.mark.parametrize("eta", [0.0, 0.5])
@pytest.mark.parametrize("timestep", [900, 437, 0])
def test_step_equals_ddim_at_a_shared_level(beta_schedule, eta, timestep):
    # 10 inference steps: diffusers goes from timestep t to t - 100 (level t+1 -> t-99); t < 100 -> ᾱ = 1 (level 0)
    sched, d = ddim(beta_schedule, 10), make(beta_schedule)
    x, v, z = rand(2, 3, 3, 4, 4, seed=5), rand(2, 3, 3, 4, 4, seed=6), rand(2, 3, 3, 4, 4, seed=7)
    from_levels = torch.full((2, 3), timestep + 1)
    to_levels = torch.full((2, 3), max(timestep - 100, -1) + 1)
    want = sched.step(v, timestep, x, eta=eta, variance_noise=z).prev_sample
    torch.testing.assert_close(d.step(x, v, from_levels, to_levels, eta, noise=z), want, **TOL)
    mean, sigma = d.transition(x, v, from_levels, to_levels, eta)
    torch.testing.assert_close(mean + sigma * z, want, **TOL)
    assert sigma.shape == (2, 3, 1, 1, 1)
    assert (sigma > 0).all() == (eta > 0 and timestep >= 100)


def test_step_with_clipping_equals_ddim_clip_sample():
    sched, d = ddim("squaredcos_cap_v2", 20, clip=True), make("squaredcos_cap_v2", clip_x0=True)
    x, v, z = 3 * rand(1, 2, 3, 4, 4, seed=8), rand(1, 2, 3, 4, 4, seed=9), rand(1, 2, 3, 4, 4, seed=10)
    want = sched.step(v, 300, x, eta=0.3, variance_noise=z).prev_sample
    got = d.step(x, v, torch.full((1, 2), 301), torch.full((1, 2), 251), 0.3, noise=z)
    torch.testing.assert_close(got, want, **TOL)
    unclipped = make("squaredcos_cap_v2").step(x, v, torch.full((1, 2), 301), torch.full((1, 2), 251), 0.3, noise=z)
    assert (unclipped - want).abs().max() > 1e-2  # the clip matters for this input


@pytest.mark.parametrize("beta_schedule", SCHEDULES)
@pytest.mark.parametrize("timestep, dtype", [(999, torch.float32), (500, torch.float32), (0, torch.float32),
                                             (999, torch.float64), (500, torch.float64), (1, torch.float64),
                                             (0, torch.float64)])
def test_eta_one_equals_ddpm_step_for_consecutive_levels(beta_schedule, timestep, dtype):
    ref = DDPMScheduler(num_train_timesteps=K, beta_schedule=beta_schedule, prediction_type="v_prediction",
                        variance_type="fixed_small", clip_sample=False)
    if dtype == torch.float64:
        # The same table, evaluated in float64. (Near level 0, e.g. timestep 1, diffusers' float32 1 − ᾱ
        # cancels — ᾱ ≈ 0.9999 — and its result drifts by ~1e-4; ours computes coefficients in float64.)
        ref.alphas_cumprod, ref.one = ref.alphas_cumprod.double(), ref.one.double()
    d = make(beta_schedule)
    x, v = rand(2, 3, 3, 4, 4, seed=11).to(dtype), rand(2, 3, 3, 4, 4, seed=12).to(dtype)
    want = ref.step(v, timestep, x, generator=torch.Generator().manual_seed(99)).prev_sample
    got = d.step(x, v, torch.full((2, 3), timestep + 1), torch.full((2, 3), timestep), eta=1.0,
                 generator=torch.Generator().manual_seed(99))  # the same draws as diffusers' randn_tensor
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("beta_schedule", SCHEDULES)
def test_mixed_levels_step_each_frame_like_diffusers(beta_schedule):
    sched, d = ddim(beta_schedule, 10), make(beta_schedule)
    x, v, z = rand(1, 4, 3, 4, 4, seed=13), rand(1, 4, 3, 4, 4, seed=14), rand(1, 4, 3, 4, 4, seed=15)
    t = [950, 620, 310, 40]  # one timestep per frame, each moving 100 timesteps (the last to level 0)
    got = d.step(x, v, torch.tensor([t]) + 1, torch.tensor([[851, 521, 211, 0]]), 0.5, noise=z)
    for j, tj in enumerate(t):
        want = sched.step(v[:, j], tj, x[:, j], eta=0.5, variance_noise=z[:, j]).prev_sample
        torch.testing.assert_close(got[:, j], want, **TOL)


def test_frames_that_stay_are_unchanged_and_level_zero_gives_x0():
    d = make("squaredcos_cap_v2")
    x, v, z = rand(2, 4, 3, 4, 4, seed=16), rand(2, 4, 3, 4, 4, seed=17), rand(2, 4, 3, 4, 4, seed=18)
    lv_from = torch.tensor([[0, 300, 700, K], [K, K, 5, 0]])
    lv_to = torch.tensor([[0, 300, 0, 900], [K, 0, 0, 0]])
    mean, sigma = d.transition(x, v, lv_from, lv_to, eta=1.0)
    stay = lv_from == lv_to
    assert torch.equal(mean[stay], x[stay]) and (sigma[stay] == 0).all()
    assert torch.equal(d.step(x, v, lv_from, lv_to, 1.0, noise=z)[stay], x[stay])
    clean = (lv_to == 0) & ~stay
    torch.testing.assert_close(mean[clean], d.pred_x0(x, v, lv_from)[clean], rtol=0, atol=1e-6)
    assert (sigma[clean] == 0).all()
    assert (sigma[0, 3] > 0).all()  # a genuine stochastic move


def test_bad_levels_and_eta_raise():
    d = make("sigmoid")
    x = torch.zeros(1, 2, 1, 2, 2)
    with pytest.raises(ValueError, match=r"only denoises: to_levels\[0, 1\] = 600 > from_levels\[0, 1\] = 500"):
        d.transition(x, x, torch.tensor([[10, 500]]), torch.tensor([[5, 600]]))
    with pytest.raises(ValueError, match="0..K=1000"):
        d.alpha_bar(torch.tensor([K + 1]))
    with pytest.raises(ValueError, match="eta must be in"):
        d.transition(x, x, torch.tensor([[10, 5]]), torch.tensor([[5, 5]]), eta=1.5)
    with pytest.raises(TypeError, match="integer"):
        d.alpha_bar(torch.tensor([0.5]))


def test_deterministic_step_draws_no_noise():
    d = make("sigmoid")
    x, v = rand(1, 2, 1, 2, 2, seed=19), rand(1, 2, 1, 2, 2, seed=20)
    g = torch.Generator().manual_seed(0)
    before = g.get_state()
    d.step(x, v, torch.tensor([[10, 20]]), torch.tensor([[5, 10]]), eta=0.0, generator=g)
    assert torch.equal(g.get_state(), before)
    a = d.step(x, v, torch.tensor([[10, 20]]), torch.tensor([[5, 10]]), 0.7, torch.Generator().manual_seed(3))
    b = d.step(x, v, torch.tensor([[10, 20]]), torch.tensor([[5, 10]]), 0.7, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_min_snr_loss_weight_caps_the_low_noise_levels():
    """min(1, 5 / (1 + SNR)): weight 1 where SNR <= 4 (the noisy levels a rollout starts from), 5/(1+SNR)
    above, 0 at the clean level; uniform is 1 everywhere."""
    d = PerFrameDiffusion(DiffusionConfig(num_levels=1000))
    levels = torch.arange(0, 1001)
    snr = d.snr(levels)
    w = d.loss_weight(levels, "min_snr", 5.0)
    assert w.dtype == torch.float32 and w[0] == 0 and w[-1] == 1
    torch.testing.assert_close(w.double(), (5.0 / (1 + snr)).clamp(max=1.0), atol=1e-6, rtol=0)
    assert (w[snr <= 4] == 1).all() and (w[snr > 4] < 1).all()
    assert (d.loss_weight(levels, "uniform") == 1).all()
    with pytest.raises(ValueError, match="unknown loss weight"):
        d.loss_weight(levels, "p2")
