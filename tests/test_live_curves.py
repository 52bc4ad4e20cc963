"""Live curves (fedcond.records.live_curves): what TensorBoard's own reader finds in a compare's folder."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

from fedcond.records.history import RoundRecord
from fedcond.records.live_curves import CHARTS, EVENT_FILE_PREFIX, SCALE, chart_values
from fedcond.tools.cli import main

COMPARE = ["compare", "--num-clusters", "2", "--clients-per-cluster", "2", "--rounds", "3", "--seeds", "0",
           "--methods", "fedavg,oracle", "local-epochs=1", "--runner", "in-process"]  # fmt: skip


def read_runs(folder: Path) -> EventMultiplexer:
    """What ``tensorboard --logdir folder`` reads: every folder below holding event files is a run."""
    runs = EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    runs.AddRunsFromDirectory(str(folder))
    runs.Reload()
    return runs


def test_a_compares_event_files_hold_every_round_of_every_run_as_its_history_says(tmp_path):
    out = tmp_path / "cmp"
    assert main([*COMPARE, "--out", str(out)]) == 0
    runs = read_runs(out)
    assert sorted(runs.Runs()) == ["runs/method-fedavg_seed-0", "runs/method-oracle_seed-0"]
    for run in runs.Runs():
        with (out / run / "history.csv").open() as handle:
            history = list(csv.DictReader(handle))
        assert len(history) == 3
        tags = set(runs.Runs()[run]["scalars"])
        for chart, column in CHARTS.items():
            expected = [(int(row["round"]), float(row[column]) * SCALE.get(column, 1.0)) for row in history]
            drawn = [(expected_round, value) for expected_round, value in expected if math.isfinite(value)]
            tag = chart.format(metric="accuracy")
            if not drawn:  # NaN every round (no newcomers, no drift, no ARI): no chart at all
                assert tag not in tags
                continue
            events = [(event.step, event.value) for event in runs.Scalars(run, tag)]
            assert [step for step, _ in events] == [step for step, _ in drawn], tag
            assert [value for _, value in events] == pytest.approx([value for _, value in drawn], rel=1e-6), tag
        for cluster in (0, 1):
            column = f"accuracy_cluster_{cluster}"
            events = runs.Scalars(run, f"clusters/accuracy of cluster {cluster}")
            assert [event.value for event in events] == pytest.approx([float(row[column]) for row in history])
        # The settings as text, once: the method among them.
        (settings,) = runs.Tensors(run, "settings/text_summary")
        assert f"| method | {run.split('method-')[1].split('_')[0]} |" in settings.tensor_proto.string_val[0].decode()


def test_live_curves_false_writes_no_event_file(tmp_path):
    out = tmp_path / "cmp"
    assert main([*COMPARE, "--out", str(out), "live-curves=false", "--rounds", "1", "--methods", "fedavg"]) == 0
    assert (out / "runs" / "method-fedavg_seed-0" / "history.csv").is_file()
    assert not [path for path in out.rglob("*") if path.name.startswith(EVENT_FILE_PREFIX)]


def test_a_round_draws_its_finite_values_only_and_bytes_as_megabytes():
    record = RoundRecord(4, 0.5, 1.2, 0.9, 2.0, 8.0, 3_000_000, 1_500_000, {0: 0.4, 1: float("nan")})
    values = chart_values(record, "rmse")
    assert values["rmse/mean"] == 0.5 and values["traffic/MB down"] == 3.0 and values["traffic/MB up"] == 1.5
    assert values["clusters/rmse of cluster 0"] == 0.4 and "clusters/rmse of cluster 1" not in values
    assert "newcomers/rmse" not in values and "clustering/ARI" not in values
