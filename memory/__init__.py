"""What the model remembers: the memory bank of past frames, compressors, KV caches, retention policies.

    from memory import MemoryBank, MemoryFrames, RetentionPolicy, KVCache, build_compressor
    from memory import PoseBank, make_bank, select_by_pose      # memory chosen by camera pose
"""

from .bank import MemoryBank, MemoryFrames
from .cache import KVCache
from .compress import COMPRESSORS, MemoryCompressor, build_compressor
from .retention import POLICIES, RetentionError, RetentionPolicy, kept_indices
from .select import SELECTIONS, PoseBank, SelectionError, make_bank, relative_pose, select_by_pose

__all__ = [
    "COMPRESSORS",
    "POLICIES",
    "SELECTIONS",
    "PoseBank",
    "SelectionError",
    "KVCache",
    "MemoryBank",
    "MemoryCompressor",
    "MemoryFrames",
    "RetentionError",
    "RetentionPolicy",
    "build_compressor",
    "kept_indices",
    "make_bank",
    "relative_pose",
    "select_by_pose",
]
