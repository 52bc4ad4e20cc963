"""experiments/head_probe.py: it rebuilds a finished run's clients' models exactly (the run's own
accuracy again, for a conditioned global model and for per-cluster models) and refuses what it cannot
probe before it starts."""

from __future__ import annotations

import csv

import pytest

from fedcond.federation.methods import run_config
from fedcond.tools.in_process import run_in_process
from tests.scripts import load_script

TINY = {"num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 2, "verbose": False}


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    runs = {}
    for method, extra in (("recommended", {}), ("oracle", {})):
        config = run_config({"method": method, **TINY, **extra, "results-dir": str(folder), "run-name": method})
        recorder, _ = run_in_process(config)
        runs[method] = recorder.folder
    return runs


@pytest.mark.parametrize("method", ["recommended", "oracle"])
def test_the_rebuilt_models_score_what_the_run_recorded(finished_runs, method):
    _, scores = load_script("experiments/head_probe.py").probe_run(finished_runs[method], "")
    assert scores["own head"] == pytest.approx(scores["recorded"], abs=1e-9)
    assert 0.0 < scores["cluster probe"] <= 1.0 and 0.0 < scores["client probe"] <= 1.0


def test_it_writes_a_table_row_per_run_and_a_metrics_row_per_head(finished_runs, tmp_path):
    out = tmp_path / "probe"
    load_script("experiments/head_probe.py").main(
        [str(folder) for folder in finished_runs.values()] + ["--out", str(out)]
    )
    table = [line for line in (out / "probe.md").read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0][2:] for row in table[1:]] == list(finished_runs)
    methods = [row["method"] for row in csv.DictReader((out / "metrics.csv").open())]
    assert methods == [f"{run}{suffix}" for run in finished_runs for suffix in ("", "+cluster-probe", "+client-probe")]


def test_it_refuses_a_folder_without_a_checkpoint_and_a_used_out_folder(finished_runs, tmp_path, capsys):
    script = load_script("experiments/head_probe.py")
    with pytest.raises(SystemExit):
        script.main([str(tmp_path), "--out", str(tmp_path / "probe")])
    assert "has no run.json and checkpoint.pt" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    existing = tmp_path / "used" / "probe.md"
    existing.write_text("kept")
    with pytest.raises(SystemExit):
        script.main([str(finished_runs["oracle"]), "--out", str(tmp_path / "used")])
    assert "is not empty; give a new --out" in capsys.readouterr().err and existing.read_text() == "kept"
