"""Hybrid attention (LightTransfer, arXiv 2410.13846) for the denoiser's temporal attention.

    from arvdm.hybrid import HybridModel, measuring, select_layers, temporal_layers
    hm = HybridModel(model, HybridConfig(fraction=0.5))       # a rollout-ready model, lazy layers streaming

arvdm/hybrid/lazy.py measures and selects lazy layers, arvdm/hybrid/convert.py converts them and wraps a
model; the offline tools (calibration, report, CLI: ``python -m arvdm.hybrid``) are in arvdm.hybrid.report,
which this package does not import (it pulls in the rollout and evaluation code).
"""

from arvdm.hybrid.convert import (
    HybridModel,
    apply_for_training,
    convert_layers,
    describe,
    keeping_sinks,
    layer_policies,
    streaming_policy,
    wrap_for_sampling,
)
from arvdm.hybrid.lazy import (
    RATIOS_NAME,
    HybridError,
    LazyRatioMeter,
    load_lazy_ratios,
    measuring,
    num_streaming,
    ratios_path,
    resolve_layers,
    select_layers,
    temporal_layers,
)

__all__ = ["RATIOS_NAME", "HybridError", "HybridModel", "LazyRatioMeter", "apply_for_training", "convert_layers",
           "describe", "keeping_sinks", "layer_policies", "load_lazy_ratios", "measuring", "num_streaming",
           "ratios_path", "resolve_layers", "select_layers", "streaming_policy", "temporal_layers", "wrap_for_sampling"]
