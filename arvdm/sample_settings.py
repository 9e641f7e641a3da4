"""sample.py's settings: one dataclass, each field a flag, checked before any work starts.

    from arvdm.sample_settings import SampleSettings
    settings = SampleSettings(schedule="fifo", frames=120, anchor_sigma=1.0).validate()
    arvdm.sampling.sample_run("runs/tiny", "runs/tiny/samples/fifo", settings)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arvdm.config import (
    FROZEN_DRAFT,
    SCHEDULE_PRESETS,
    Config,
    SamplingError,
    parse_device,
)
from arvdm.setting_checks import check_anchor_sigma, check_eta, check_guidance
from memory.select import SELECTIONS  # how a pose-aware run may choose memory at sampling

__all__ = ["SampleSettings"]


@dataclass
class SampleSettings:
    """How `sample.py` / `arvdm.sampling.sample_run` rolls a trained run out (each field is a sample.py flag)."""

    frames: int | None = None  # frames to generate; None = all the episodes hold after the context
    schedule: str = "chunked"  # chunked | fifo | pyramid | path to a schedule file
    steps: int = 20  # denoising calls each frame takes from K to 0 (the presets compare at equal steps)
    context: int | None = None  # ground-truth frames to condition on; None = Config.default_context()
    episodes: int = 4
    batch_size: int = 4
    eta: float | None = None  # 0 = DDIM, 1 = DDPM-like; None = the run's diffusion.eta
    seed: int = 0
    use_cache: bool = True  # False = recompute the memory at every denoising call (Diffusion Forcing)
    evaluate: bool = False
    data: str | None = None  # TECO-layout folder; None = the run's own cfg.data.path
    split: str = "validation"  # which split of the data folder to roll out (validation | training)
    use_ema: bool = True
    device: str = "auto"
    progress: bool = True
    hybrid: dict[str, Any] | None = None  # hybrid-attention overrides, e.g. {"fraction": 0.5} (arvdm.hybrid)
    compile: bool = False  # torch.compile the denoiser's forward (the KV-cache length is marked dynamic)
    context_level: int | None = None  # k_ctx of finished frames in memory; None = the run's / a schedule file's
    history_guidance: float = 0.0  # W: v = v_mem + W (v_mem - v_nomem) (DFoT); 0 = no guidance, one call per row
    action_guidance: float = 0.0  # W_a: v += W_a (v - v_noact) (CFG over the actions); 0 = no guidance
    candidates: int = 1  # N: per AR step keep the medoid of N candidates (minimum Bayes risk); N times the compute
    anchor_sigma: float | None = None  # σ px: low frequencies held to the level-K x̂0 (arvdm.pipeline.anchor); 0 = off;
    #   None = the run's diffusion.anchor_sigma (0 with --speculate)
    anchor_floor: int | None = None  # the anchor pulls in calls that start above this level only; 0 = every call;
    #   None = the run's diffusion.anchor_floor (0 when there is no anchor)
    anchor_runs: tuple[str, ...] = ()  # other runs of the same config whose level-K v is averaged into the anchor
    #   (arvdm.pipeline.anchor.AnchorEnsemble); () = the sampled run's alone
    speculate: str | None = None  # None | "ucb" | "exp3" | "fixed:L": exact speculative rows (needs eta > 0)
    draft: str = FROZEN_DRAFT  # "frozen" or the folder of a smaller trained run used as the draft
    lookaheads: tuple[int, ...] = (1, 2, 3, 4)  # the bandits' arms (L = 1: no speculation)
    level_bins: int = 1  # > 1: one bandit per bin of the noise level a round starts from
    memory_select: str | None = None  # pose-aware runs: pose | time | none | other (memory.SELECTIONS); None = pose

    def validate(self) -> SampleSettings:
        """Check every setting before any work starts; errors name the sample.py flag."""
        for flag, value, lo in (("--frames", self.frames, 1), ("--steps", self.steps, 1),
                                ("--context", self.context, 0), ("--episodes", self.episodes, 1),
                                ("--batch-size", self.batch_size, 1), ("--seed", self.seed, 0),
                                ("--context-level", self.context_level, 0), ("--candidates", self.candidates, 1),
                                ("--anchor-floor", self.anchor_floor, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
                raise SamplingError(f"{flag} must be an integer >= {lo}, got {value!r}")
        if self.eta is not None:
            check_eta(self.eta, "--eta", SamplingError)
        if self.memory_select not in (None, *SELECTIONS):
            raise SamplingError(f"--memory-select {self.memory_select!r}: choose one of {', '.join(SELECTIONS)}")
        check_guidance(self.history_guidance, "--history-guidance", SamplingError)
        check_guidance(self.action_guidance, "--action-guidance", SamplingError)
        if self.anchor_sigma is not None and check_anchor_sigma(self.anchor_sigma, "--anchor-sigma",
                                                                SamplingError) > 0 and self.speculate:
            raise SamplingError(f"--anchor-sigma {self.anchor_sigma} cannot go with --speculate (the anchor moves each "
                                "call's v; speculative rows verify drafted rows in one call)")
        if self.anchor_floor and self.anchor_sigma == 0:
            raise SamplingError(f"--anchor-floor {self.anchor_floor} needs --anchor-sigma > 0 (it is the level the "
                                "anchor's pull stops at; without an anchor there is nothing to stop)")
        self._check_anchor_runs()
        if self.candidates > 1 and (self.speculate or self.memory_select == "other"):
            raise SamplingError(f"--candidates {self.candidates} cannot go with --speculate or --memory-select other "
                                "(speculative rows keep per-sample state; 'other' reads the neighbouring sample)")
        if str(self.schedule) not in SCHEDULE_PRESETS and not Path(self.schedule).is_file():
            raise SamplingError(f"--schedule {self.schedule}: unknown schedule, not a preset "
                                f"({', '.join(SCHEDULE_PRESETS)}) and no such file")
        if self.data is not None and not Path(self.data).is_dir():
            raise SamplingError(f"--data {self.data}: folder does not exist")
        parse_device(self.device)
        return self

    def _check_anchor_runs(self) -> None:
        if not self.anchor_runs:
            return
        runs = ",".join(map(str, self.anchor_runs))
        if self.speculate or self.anchor_sigma == 0:
            raise SamplingError(f"--anchor-runs {runs} needs an anchor (--anchor-sigma > 0, the run's by default) "
                                "and cannot go with --speculate: the runs' mean only sets the anchor")
        for run in self.anchor_runs:
            if not Path(run).is_dir():
                raise SamplingError(f"--anchor-runs: {run}: no such run folder")

    def with_run_defaults(self, cfg: Config) -> SampleSettings:
        """These settings with every "None = the run's" field filled from the run's config (``cfg.diffusion``), as
        they are used and recorded: eta; k_ctx for a preset schedule (speculative rows keep the schedule's 0, a
        schedule file its own); the anchor's σ (0 with --speculate, which does not support it) and floor."""
        d = cfg.diffusion
        eta = d.eta if self.eta is None else self.eta
        level = self.context_level
        if level is None and str(self.schedule) in SCHEDULE_PRESETS and not self.speculate:
            level = d.context_level
        sigma, floor = d.anchor(self.anchor_sigma, self.anchor_floor, ("--anchor-sigma", "--anchor-floor"),
                                supported=not self.speculate)
        return dataclasses.replace(self, eta=eta, context_level=level, anchor_sigma=sigma,
                                   anchor_floor=floor).validate()
