"""What the model remembers: the memory bank of past frames, compressors, KV caches, retention policies.

    from memory import MemoryBank, MemoryFrames, RetentionPolicy, KVCache, build_compressor
"""

from .bank import MemoryBank, MemoryFrames
from .cache import KVCache
from .compress import COMPRESSORS, MemoryCompressor, build_compressor
from .retention import POLICIES, RetentionError, RetentionPolicy, kept_indices

__all__ = [
    "COMPRESSORS",
    "POLICIES",
    "KVCache",
    "MemoryBank",
    "MemoryCompressor",
    "MemoryFrames",
    "RetentionError",
    "RetentionPolicy",
    "build_compressor",
    "kept_indices",
]
