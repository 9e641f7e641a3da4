"""The video denoiser, its per-frame diffusion and its weights I/O.

    from arvdm.model import Denoiser, PerFrameDiffusion
    model = Denoiser(cfg)                       # arvdm/model/denoiser.py
    model.save_pretrained("out/"); Denoiser.from_pretrained("out/")
"""

from arvdm.model.checkpoint import CheckpointError, from_pretrained, load_weights, save_pretrained
from arvdm.model.denoiser import Denoiser, DenoiserError, DenoiserOutput
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.model.state import RolloutState

__all__ = ["CheckpointError", "Denoiser", "DenoiserError", "DenoiserOutput", "PerFrameDiffusion", "RolloutState",
           "from_pretrained", "load_weights", "save_pretrained"]
