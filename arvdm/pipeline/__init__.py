"""The pipeline: a trained model's long rollouts under a Meta-ARVDM schedule, runs on disk, video files.

    from arvdm.pipeline import rollout, load_for_inference, load_validation_episodes
"""

from arvdm.pipeline.rollout import candidate_generators, episode_generators, medoid, rollout
from arvdm.pipeline.rollout_model import RolloutModel
from arvdm.pipeline.rows import PlainRows, RolloutContext, RolloutStep, RowRunner
from arvdm.pipeline.runs import load_for_inference, load_validation_episodes
from arvdm.pipeline.video import filmstrip, side_by_side, to_uint8, write_image, write_video

__all__ = ["rollout", "episode_generators", "candidate_generators", "medoid", "RolloutModel", "RowRunner", "PlainRows",
           "RolloutContext", "RolloutStep",
           "load_for_inference", "load_validation_episodes", "to_uint8", "side_by_side", "filmstrip",
           "write_video", "write_image"]
