"""arvdm.evaluation.pareto / tables / plots and the paper's numbers (arvdm.experiments.paper): Pareto frontier on
known point sets (ties, duplicates, missing values), tables, plots."""

import csv
import math

import pytest

from arvdm.evaluation.pareto import pareto_frontier, plot_pareto
from arvdm.evaluation.plots import plot_error_accumulation, plot_retrieval_by_span
from arvdm.evaluation.tables import write_results_table
from arvdm.experiments.paper import paper_reference

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_frontier_known_set():
    # x = decay (lower better), y = retrieval (higher better)
    pts = [
        (1.0, 0.2),  # 0 frontier (lowest decay)
        (2.0, 0.5),  # 1 frontier
        (3.0, 0.4),  # 2 dominated by 1
        (4.0, 0.9),  # 3 frontier (best retrieval)
        (0.5, 0.1),  # 4 frontier (even lower decay)
        (5.0, 0.9),  # 5 dominated by 3 (same y, worse x)
        (2.0, 0.3),  # 6 dominated by 1 (same x, worse y)
    ]
    assert pareto_frontier(pts) == [4, 0, 1, 3]


def test_frontier_ties_duplicates_and_missing():
    pts = [
        {"x": 1.0, "y": 0.5},  # 0 frontier
        {"x": 1.0, "y": 0.5},  # 1 exact duplicate of 0: also on the frontier
        {"x": 1.0, "y": 0.4},  # 2 same x, lower y: dominated
        {"x": 2.0, "y": 0.5},  # 3 same y, higher x: dominated
        {"x": 0.2, "y": None},  # 4 no retrieval probes: never on the frontier
        {"x": float("nan"), "y": 1.0},  # 5 missing decay
        {"x": 3.0, "y": 0.8},  # 6 frontier
    ]
    assert pareto_frontier(pts) == [0, 1, 6]
    assert pareto_frontier([]) == []
    assert pareto_frontier([(1.0, 1.0)]) == [0]
    # A single point dominating everything
    assert pareto_frontier([(2, 2), (0, 3), (1, 1), (5, 0)]) == [1]


def test_write_results_table(tmp_path):
    rows = [
        {"name": "prepend m=16", "max_psnr_decay": 2.3456789, "retrieval_mean": 0.5},
        {"name": "concat|m=112", "max_psnr_decay": 1.0, "retrieval_mean": None, "budget": 8},
    ]
    out = tmp_path / "t"
    csv_path, md_path = write_results_table(rows, out / "results.csv", out / "results.md")
    back = list(csv.DictReader(csv_path.open()))
    assert list(back[0]) == ["name", "max_psnr_decay", "retrieval_mean", "budget"]
    assert back[0]["max_psnr_decay"] == "2.3456789" and back[0]["budget"] == ""
    assert back[1]["retrieval_mean"] == "" and back[1]["budget"] == "8"
    assert md_path.read_text().splitlines() == [
        "| name | max_psnr_decay | retrieval_mean | budget |",
        "|---|---|---|---|",
        "| prepend m=16 | 2.346 | 0.5 |  |",
        "| concat\\|m=112 | 1 |  | 8 |",
    ]
    assert sorted(p.name for p in csv_path.parent.iterdir()) == ["results.csv", "results.md"]


def test_plots_are_written(tmp_path):
    curves = {"prepend m=16": [12.0 - 0.05 * t for t in range(64)],
              "concat m=112": [[11.0] * 64, [10.0] * 64]}  # (B, T): averaged over B
    p1 = plot_error_accumulation(curves, tmp_path / "psnr.png", reference=paper_reference()["psnr_by_span"])
    rates = {"prepend m=16": {"0-16": 0.5, "16-48": 0.1, "48-112": None}, "concat m=112": {"0-16": 0.2}}
    p2 = plot_retrieval_by_span(rates, tmp_path / "retrieval.png",
                                reference=paper_reference()["retrieval_by_span"],
                                counts={"prepend m=16": {"0-16": 12, "16-48": 7}})
    points = [{"name": "a", "x": 1.0, "y": 0.2}, {"name": "b", "x": 2.0, "y": 0.5},
              {"name": "c", "x": 3.0, "y": 0.4}, {"name": "d", "x": 2.5, "y": None}]
    front = plot_pareto(points, tmp_path / "pareto.png", reference=paper_reference()["pareto_points"])
    assert front == [0, 1]
    for p in (p1, p2, tmp_path / "pareto.png"):
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    rows = list(csv.DictReader((tmp_path / "pareto.csv").open()))
    assert [(r["name"], r["on_frontier"]) for r in rows] == [("a", "1"), ("b", "1"), ("c", "0"), ("d", "0")]
    assert rows[3]["mean_retrieval_rate"] == ""
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left
    with pytest.raises(ValueError):
        plot_error_accumulation({}, tmp_path / "empty.png")


def test_paper_reference_numbers():
    ref = paper_reference()
    r = ref["retrieval_by_span"]
    assert r["prepend m=112"] == {"0-16": 0.48, "16-48": 0.28, "48-112": 0.23}
    assert r["prepend m=16"] == {"0-16": 0.52, "16-48": 0.03, "48-112": 0.00}
    assert r["channel concat m=112"] == {"0-16": 0.12, "16-48": 0.13, "48-112": 0.08}
    assert set(r["cross-attn m=112"].values()) == {0.0}
    assert ref["psnr_by_span"]["prepend m=48 joint B=8"] == {"0-16": 10.24, "48-64": 7.88}
    assert ref["max_psnr_decay"] == {"prepend m=48 joint B=8": 2.36, "prepend m=48 joint B=48": 3.76}
    # The paper's two compression points form a frontier of their own: more memory, more decay.
    pts = ref["pareto_points"]
    assert [p["y"] for p in pts] == [pytest.approx(0.5 / 3, abs=1e-4), pytest.approx(0.74 / 3, abs=1e-4)]
    assert pareto_frontier(pts) == [0, 1]
    ref["psnr_by_span"].clear()  # a fresh dict each call
    assert paper_reference()["psnr_by_span"]
    assert not math.isnan(pts[0]["x"])
