"""Fairness across clients: every round's worst client, 10th percentile and spread, for the training
clients and the newcomers, in history.csv, the summaries and the plots."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from fedcond.records.history import SPREAD_COLUMNS
from fedcond.records.metrics import ClientEvaluation, Spread
from fedcond.tools.in_process import run_in_process
from fedcond.tools.report import MethodSummary, summary_table
from tests.test_one_message import config_for


def evaluation(accuracy: float, num_samples: int = 10) -> ClientEvaluation:
    return ClientEvaluation(cluster=0, num_samples=num_samples, loss=1.0, accuracy=accuracy)


def test_the_spread_counts_each_client_once_whatever_its_test_size():
    spread = Spread.of([evaluation(0.2, 1), evaluation(0.9, 1000), evaluation(0.6, 10), evaluation(0.7, 10)])
    assert spread.worst == 0.2
    assert spread.p10 == pytest.approx(np.percentile([0.2, 0.6, 0.7, 0.9], 10))  # 0.32, unweighted
    assert spread.std == pytest.approx(np.std([0.2, 0.6, 0.7, 0.9]))
    assert all(math.isnan(value) for value in Spread.of([]).as_fields("heldout_").values())


def test_every_round_records_the_worst_client_of_participants_and_newcomers(tmp_path):
    config = config_for("fedavg", tmp_path, True, **{"held-out-clients": 1})
    recorder, _ = run_in_process(config)
    with (recorder.folder / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        assert set(SPREAD_COLUMNS) <= set(row)
        worst, p10, mean = (float(row[key]) for key in ("worst_accuracy", "p10_accuracy", "accuracy"))
        assert 0 <= worst <= p10 <= mean <= 1 and float(row["accuracy_std"]) >= 0
        # Per-cluster means bound the worst client from above.
        clusters = [float(value) for key, value in row.items() if key.startswith("accuracy_cluster_")]
        assert worst <= min(clusters)
        newcomer_worst = float(row["heldout_worst_accuracy"])
        assert 0 <= newcomer_worst <= float(row["heldout_accuracy"])


def test_the_summary_shows_the_worst_client_where_runs_measured_it():
    def summary(method: str, worst: float, heldout_worst: float = math.nan) -> MethodSummary:
        return MethodSummary(method, 1, 0.8, math.nan, 3, 0.8, 3, 1.0, 1.0, 1.0, math.nan, math.nan, worst,
                             heldout_worst)  # fmt: skip

    table = summary_table([summary("fedavg", 0.41), summary("ditto", 0.77)])
    assert "| worst client |" in table and "| 0.410 |" in table and "worst held-out" not in table
    assert "worst client" not in summary_table([summary("fedavg", math.nan)])  # older runs: no column


@pytest.mark.parametrize("evaluate_in_fit", [False, True])
def test_per_class_accuracy_scores_every_class_of_the_final_round_and_nothing_is_sent_without_it(
    tmp_path, evaluate_in_fit
):
    """Digits E1 K=2 x 2 and a newcomer each: the classes' accuracies, weighted by their samples, are
    the final round's accuracy (participants and newcomers alike), every test sample is counted once,
    and the class names are the dataset's; off (the default), run.json has none."""
    import json

    from fedcond.data.scenarios import scenario_for

    config = config_for(
        "fedavg", tmp_path / "on", evaluate_in_fit, **{"held-out-clients": 1, "per-class-accuracy": True}
    )
    recorder, _ = run_in_process(config)
    info = json.loads((recorder.folder / "run.json").read_text())
    with (recorder.folder / "history.csv").open() as handle:
        last = list(csv.DictReader(handle))[-1]
    tests = [len(client.test_indices) for client in scenario_for(config).clients]  # 4 participants, 2 newcomers
    for group, accuracy, tested in (
        ("participants", "accuracy", tests[:4]),
        ("newcomers", "heldout_accuracy", tests[4:]),
    ):
        classes = info["final_class_accuracy"][group]
        assert list(classes) == [str(digit) for digit in range(10)]
        samples = sum(cell["samples"] for cell in classes.values())
        assert samples == sum(tested)
        weighted = sum(cell["accuracy"] * cell["samples"] for cell in classes.values() if cell["samples"]) / samples
        assert weighted == pytest.approx(float(last[accuracy]))
    recorder, _ = run_in_process(config_for("fedavg", tmp_path / "off", evaluate_in_fit, **{"held-out-clients": 1}))
    assert "final_class_accuracy" not in json.loads((recorder.folder / "run.json").read_text())
