"""The paper's published DMLab numbers, to overlay on a grid's plots (``report.paper_reference: true``).

    from arvdm.experiments.paper import paper_reference
    ref = paper_reference()          # a fresh dict: retrieval_by_span, psnr_by_span, max_psnr_decay, pareto_points

Source: Meta-ARVDM v1 (arXiv 2503.10704), DMLab at 64x64. Only the configurations and spans the paper
quotes are here; they are reference marks, not comparable results (other data and model scale).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PAPER_SOURCE", "paper_reference"]

PAPER_SOURCE = "Meta-ARVDM v1 (arXiv 2503.10704), DMLab 64x64"

#: Retrieval rate per gap bin (frames back), per configuration.
_RETRIEVAL_BINS = ("0-16", "16-48", "48-112")
_RETRIEVAL = {
    "prepend m=16": (0.52, 0.03, 0.00),
    "prepend m=48": (0.44, 0.32, 0.00),
    "prepend m=112": (0.48, 0.28, 0.23),
    "channel concat m=112": (0.12, 0.13, 0.08),
    "cross-attn m=112": (0.00, 0.00, 0.00),
    "prepend m=48 joint B=8": (0.28, 0.22, 0.00),
    "prepend m=48 joint B=48": (0.40, 0.34, 0.00),
}
#: Mean PSNR (dB) of the two spans the paper quotes, for the configurations it quotes them for.
_PSNR = {
    "prepend m=48 joint B=8": {"0-16": 10.24, "48-64": 7.88},
    "prepend m=48 joint B=48": {"0-16": 10.52, "48-64": 6.76},
}
#: Decimals the derived numbers are rounded to (the paper's own precision and a little more).
_DECAY_DECIMALS = 2
_RATE_DECIMALS = 4


def paper_reference() -> dict[str, Any]:
    """The paper's DMLab numbers (Meta-ARVDM v1, arXiv 2503.10704; 64x64) for overlaying on our plots.

    Returns a fresh dict:
        ``retrieval_by_span``: config name -> {"0-16", "16-48", "48-112": rate};
        ``psnr_by_span``: config name -> {"0-16", "48-64": PSNR dB} (the two spans the paper quotes);
        ``max_psnr_decay``: config name -> first minus last quoted span (dB);
        ``pareto_points``: [{"name", "x", "y"}] for the configs with both numbers (x = decay, y = mean of the
        three retrieval rates).
    """
    psnr = {k: dict(v) for k, v in _PSNR.items()}
    decay = {k: round(v["0-16"] - v["48-64"], _DECAY_DECIMALS) for k, v in psnr.items()}
    return {
        "source": PAPER_SOURCE,
        "retrieval_by_span": {k: dict(zip(_RETRIEVAL_BINS, v)) for k, v in _RETRIEVAL.items()},
        "psnr_by_span": psnr,
        "max_psnr_decay": decay,
        "pareto_points": [
            {"name": k, "x": decay[k], "y": round(sum(_RETRIEVAL[k]) / len(_RETRIEVAL_BINS), _RATE_DECIMALS)}
            for k in psnr
        ],
    }
