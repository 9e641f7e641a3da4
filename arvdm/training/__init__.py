"""Training of the denoiser: diffusion forcing with memory, exact resume, DistributedDataParallel.

    from arvdm.training import train
    train(cfg, "runs/tiny")
"""

from arvdm.training.distributed import DistributedError
from arvdm.training.loader import ResumableSampler, TrainingError, prepare_data
from arvdm.training.objective import diffusion_forcing_loss, lr_factor
from arvdm.training.trainer import Trainer, train

__all__ = ["DistributedError", "ResumableSampler", "Trainer", "TrainingError", "diffusion_forcing_loss", "lr_factor",
           "prepare_data", "train"]
