"""Evaluation of rollouts against ground truth: per-frame metrics, trivial baselines, revisit retrieval,
memory probes with event-level intervals, the hold-up horizon, ``eval.json``, and the tables and plots (Pareto
frontier included) that compare configurations.

    from arvdm.evaluation import evaluate_rollout, write_eval_json, pareto_frontier

Works on tensors and files only: nothing here imports a model, a pipeline or training code.
"""

from arvdm.evaluation.baselines import baseline_frames, compare_with_baselines, gradient_ratio_by_span, verdict
from arvdm.evaluation.evaluate import (
    EVAL_FORMAT,
    REQUIRED_EVAL_KEYS,
    evaluate_rollout,
    read_eval_json,
    to_jsonable,
    write_eval_json,
)
from arvdm.evaluation.holdup import context_views, hold_up, hold_up_horizon, span_differences
from arvdm.evaluation.metrics import (
    PSNR_CAP,
    frechet_distance,
    fvd,
    lpips_per_frame,
    max_psnr_decay,
    psnr_per_frame,
    spatial_gradient_per_frame,
    ssim_per_frame,
    summarise_by_span,
    write_metrics_csv,
)
from arvdm.evaluation.pareto import pareto_frontier, plot_pareto, write_points_csv
from arvdm.evaluation.plots import plot_error_accumulation, plot_retrieval_by_span
from arvdm.evaluation.probes import (
    DEFAULT_PSNR_THRESHOLD,
    MIN_EVENTS,
    MemoryProbe,
    binned,
    gaps,
    memory_probes,
    memory_probes_batch,
    paired_difference,
    pooled_rate,
    psnr_matrix,
    values_at,
)
from arvdm.evaluation.retrieval import (
    DEFAULT_BINS,
    calibrate_threshold,
    evaluate_retrieval,
    mean_retrieval_rate,
    retrieval_by_span,
)
from arvdm.evaluation.revisits import Probe, find_revisits, needle_probe
from arvdm.evaluation.tables import write_results_table

__all__ = [
    "DEFAULT_BINS",
    "DEFAULT_PSNR_THRESHOLD",
    "EVAL_FORMAT",
    "MIN_EVENTS",
    "MemoryProbe",
    "PSNR_CAP",
    "REQUIRED_EVAL_KEYS",
    "Probe",
    "baseline_frames",
    "binned",
    "calibrate_threshold",
    "compare_with_baselines",
    "context_views",
    "evaluate_retrieval",
    "evaluate_rollout",
    "find_revisits",
    "frechet_distance",
    "fvd",
    "gaps",
    "gradient_ratio_by_span",
    "hold_up",
    "hold_up_horizon",
    "lpips_per_frame",
    "max_psnr_decay",
    "mean_retrieval_rate",
    "memory_probes",
    "memory_probes_batch",
    "needle_probe",
    "paired_difference",
    "pareto_frontier",
    "plot_error_accumulation",
    "plot_pareto",
    "plot_retrieval_by_span",
    "pooled_rate",
    "psnr_matrix",
    "psnr_per_frame",
    "read_eval_json",
    "retrieval_by_span",
    "span_differences",
    "spatial_gradient_per_frame",
    "ssim_per_frame",
    "summarise_by_span",
    "to_jsonable",
    "values_at",
    "verdict",
    "write_eval_json",
    "write_metrics_csv",
    "write_points_csv",
    "write_results_table",
]
