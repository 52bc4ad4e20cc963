"""fedcond compare / sweep: the tidy schema, resuming, the reports, the grid files, one real compare."""

import csv
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.records.history import RoundRecord, RunRecorder, results_folder, run_status
from fedcond.tools.cli import default_config, main
from fedcond.tools.experiment import (
    METRIC_COLUMNS,
    Experiment,
    TableSpec,
    experiment_lock,
    load_experiment,
    plan,
    read_grid_file,
    record_experiment,
    run_experiment,
    tidy_rows,
    write_metrics,
)
from fedcond.tools.report import confidence_half_width, paper_table, render, summarise, summary_table

ALL_GRIDS = sorted((Path(__file__).resolve().parent.parent / "experiments" / "grids").glob("*.toml"))
# One grid file per table of the paper; the fingerprint study's grids follow its own budget.
GRIDS = [grid for grid in ALL_GRIDS if not grid.stem.startswith("fingerprints-")]
STUDY_GRIDS = [grid for grid in ALL_GRIDS if grid.stem.startswith("fingerprints-")]


class FakeRunner:
    """Writes a run's folder as the ServerApp would, with accuracy a known function of the settings."""

    def __init__(self, fail_method: str | None = None) -> None:
        self.calls: list[RunConfig] = []
        self.fail_method = fail_method

    def accuracy(self, config: RunConfig, round_number: int) -> float:
        bonus = {"oracle": 0.3, "conditional": 0.2, "fedavg": 0.0}.get(config.method, 0.1)
        return min(1.0, 0.1 * round_number + bonus + 0.01 * config.seed + 0.01 * config.num_clusters)

    def __call__(self, config: RunConfig) -> None:
        self.calls.append(config)
        recorder = RunRecorder(results_folder(config), config.resolved(), {}, config.num_clusters)
        if config.method == self.fail_method:
            recorder.fail("loss became NaN in round 1; lower learning-rate")
            return
        for number in range(1, config.num_server_rounds + 1):
            accuracy = self.accuracy(config, number)
            heldout = accuracy - 0.05 if config.held_out_clients else float("nan")
            record = RoundRecord(
                number, accuracy, 1.0 / number, 1.0, 1.5, 1.5 * number, 1000, 500, heldout_accuracy=heldout
            )
            recorder.add(record)
        recorder.finish()


def small_experiment(**axes) -> Experiment:
    settings = {"num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 3}
    return Experiment(settings, {"method": ["fedavg", "conditional"], "seed": [0, 1], **axes}, kind="compare")


def test_metrics_csv_is_tidy_one_row_per_method_seed_round(tmp_path):
    runner = FakeRunner()
    run_experiment(small_experiment(), default_config(), tmp_path, runner, io.StringIO())
    with write_metrics(small_experiment(), tmp_path).open() as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert reader.fieldnames[:10] == [
        "dataset", "scenario", "num_clusters", "clients_per_cluster", "data_fraction", "rotations",
        "fingerprint", "conditioning", "method", "seed",
    ]  # fmt: skip
    # Who took part (history.csv's clients_* columns) follows the metrics: every run here has them.
    participation = ["clients_asked", "clients_answered", "clients_failed", "clients_timed_out", "clients_evaluated"]
    # Then the code each run came from (fedcond.records.provenance): these runs know it.
    assert [*METRIC_COLUMNS, *participation, "code"] == reader.fieldnames[10:]
    for column in ("accuracy", "loss", "seconds", "bytes_down", "bytes_up", "ari"):
        assert column in reader.fieldnames
    assert len(rows) == 2 * 2 * 3
    assert {(r["method"], r["seed"], r["round"]) for r in rows} == {
        (m, s, r) for m in ("fedavg", "conditional") for s in ("0", "1") for r in ("1", "2", "3")
    }
    conditional = [r for r in rows if r["method"] == "conditional" and r["seed"] == "1" and r["round"] == "3"]
    assert float(conditional[0]["accuracy"]) == pytest.approx(0.1 * 3 + 0.2 + 0.01 + 0.02)
    assert conditional[0]["dataset"] == "digits" and conditional[0]["num_clusters"] == "2"


def test_rerun_skips_finished_runs_and_redoes_interrupted_ones(tmp_path):
    first = FakeRunner()
    run_experiment(small_experiment(), default_config(), tmp_path, first, io.StringIO())
    assert len(first.calls) == 4
    # An interrupted run leaves run.json saying "running": it must be redone from scratch.
    info_path = tmp_path / "runs" / "method-fedavg_seed-1" / "run.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "status": "running"}))
    second = FakeRunner()
    stream = io.StringIO()
    run_experiment(small_experiment(), default_config(), tmp_path, second, stream)
    assert [(c.method, c.seed) for c in second.calls] == [("fedavg", 1)]
    assert "3 finished before, 1 to run" in stream.getvalue()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(
        f"method-{m}_seed-{s}" for m in ("fedavg", "conditional") for s in (0, 1)
    )
    # Widening the grid (a third seed) runs only the new points.
    third = FakeRunner()
    wider = small_experiment()
    wider.axes["seed"] = [0, 1, 2]
    run_experiment(wider, default_config(), tmp_path, third, io.StringIO())
    assert sorted((c.method, c.seed) for c in third.calls) == [("conditional", 2), ("fedavg", 2)]


def test_how_often_a_sweep_saves_checkpoints_may_change_in_its_folder_and_redoes_no_run(tmp_path):
    run_experiment(small_experiment(), default_config(), tmp_path, FakeRunner(), io.StringIO())
    later = small_experiment()
    later.settings["checkpoint-every"] = 250  # how a run saves, not what it computes
    again = FakeRunner()
    run_experiment(later, default_config(), tmp_path, again, io.StringIO())
    assert again.calls == []
    later.settings["learning-rate"] = 0.05
    with pytest.raises(FedcondError, match="changed: learning-rate"):
        run_experiment(later, default_config(), tmp_path, again, io.StringIO())


@pytest.mark.parametrize(("planned", "skipped"), [({}, True), ({"channels-last": True}, False)])
def test_a_run_finished_before_a_setting_existed_counts_as_run_at_its_default(tmp_path, planned, skipped):
    """A sweep resumed after an upgrade that added settings (channels-last, clients-per-round, ...)
    keeps the runs that ran at what are now those settings' defaults, and refuses to mix in a
    finished run where the plan asks for another value."""
    run_experiment(small_experiment(), default_config(), tmp_path, FakeRunner(), io.StringIO())
    for info_path in (tmp_path / "runs").glob("*/run.json"):  # as a run recorded before they existed
        info = json.loads(info_path.read_text())
        for key in ("channels-last", "clients-per-round", "evaluate-every", "evaluate-in-fit", "hidden-units"):
            del info["config"][key]
        info_path.write_text(json.dumps(info))
    later = small_experiment()
    later.settings.update(planned)
    again = FakeRunner()
    if skipped:
        run_experiment(later, default_config(), tmp_path, again, io.StringIO())
        assert again.calls == []
    else:
        with pytest.raises(FedcondError, match="changed: channels-last"):
            run_experiment(later, default_config(), tmp_path, again, io.StringIO())


@pytest.mark.parametrize(
    ("recorded", "planned", "kept"),
    [
        ("absent", {}, False),  # made before the setting existed: the default layout, not CIFAR's auto
        ("absent", {"channels-last": False}, True),
        (False, {"channels-last": "false"}, True),  # recorded when it was a yes/no setting
        (True, {}, True),  # auto is channels-last for CIFAR
        (False, {}, False),
    ],
)
def test_a_cifar_run_recorded_before_channels_last_was_its_default_keeps_its_layout(recorded, planned, kept):
    from fedcond.federation.methods import run_config
    from fedcond.tools.experiment import comparable_config, with_later_settings

    plan = run_config({**default_config(), "dataset": "cifar10", **planned})
    record = plan.resolved().to_mapping()
    if recorded == "absent":
        del record["channels-last"]
    else:
        record["channels-last"] = recorded
    wanted = comparable_config(plan.resolved().to_mapping())
    assert (with_later_settings(record, plan)["channels-last"] == wanted["channels-last"]) is kept


def test_a_different_design_in_the_same_folder_is_refused(tmp_path):
    run_experiment(small_experiment(), default_config(), tmp_path, FakeRunner(), io.StringIO())
    changed = small_experiment()
    changed.settings["num-server-rounds"] = 5
    with pytest.raises(FedcondError, match="num-server-rounds"):
        run_experiment(changed, default_config(), tmp_path, FakeRunner(), io.StringIO())


@pytest.mark.slow
def test_progress_names_the_run_the_round_and_the_time_left(tmp_path):
    stream = io.StringIO()
    run_experiment(small_experiment(), default_config(), tmp_path, SlowRunner(), stream)
    text = stream.getvalue()
    assert "[1/4] method-fedavg_seed-0" in text
    assert "round 3/3 accuracy" in text and "left" in text


def test_progress_shows_every_round_even_of_a_run_faster_than_its_polling(tmp_path):
    stream = io.StringIO()
    run_experiment(small_experiment(), default_config(), tmp_path, FakeRunner(), stream)
    for position in range(1, 5):
        assert stream.getvalue().count(f"  [{position}/4] ") == 3  # one line per round of each run


class SlowRunner(FakeRunner):
    """Gives the progress watcher time to see the rounds appear."""

    def __call__(self, config: RunConfig) -> None:
        import time

        super().__call__(config)
        time.sleep(1.2)


def test_failed_runs_are_reported_and_make_the_command_fail(tmp_path):
    runner = FakeRunner(fail_method="conditional")
    experiment = small_experiment()
    run_experiment(experiment, default_config(), tmp_path, runner, io.StringIO())
    write_metrics(experiment, tmp_path)
    from fedcond.tools.experiment import failed_runs

    failures = failed_runs(experiment, tmp_path)
    assert [name for name, _ in failures] == ["method-conditional_seed-0", "method-conditional_seed-1"]
    render(tmp_path, "t", "compare", [], ["dataset"], failures)
    summary = (tmp_path / "summary.md").read_text()
    assert "did not finish" in summary and "NaN" in summary


def synthetic_rows() -> list[dict[str, str]]:
    rows = []
    finals = {("fedavg", "2"): [0.50, 0.54], ("oracle", "2"): [0.90, 0.94], ("fedavg", "5"): [0.30, 0.32]}
    finals[("oracle", "5")] = [0.95, 0.97]
    for (method, k), accuracies in finals.items():
        for seed, final in enumerate(accuracies):
            for number in (1, 2):
                rows.append({
                    "dataset": "mnist", "scenario": "label-shift", "num_clusters": k, "clients_per_cluster": "5",
                    "data_fraction": "1.0", "rotations": "", "method": method, "seed": str(seed),
                    "round": str(number), "accuracy": str(final if number == 2 else final / 2), "loss": "1",
                    "seconds": "2", "bytes_down": "2000000", "bytes_up": "1000000", "ari": "nan",
                    "train_loss": "1", "elapsed_seconds": str(2 * number),
                })  # fmt: skip
    return rows


def test_summary_ranks_methods_with_confidence_intervals():
    rows = [r for r in synthetic_rows() if r["num_clusters"] == "2"]
    oracle, fedavg = summarise(rows)
    assert (oracle.method, fedavg.method) == ("oracle", "fedavg")
    assert oracle.final_mean == pytest.approx(0.92) and oracle.seeds == 2
    # t(0.975, 1) = 12.706; std of {0.90, 0.94} = 0.02828; half-width = 12.706 * 0.02828 / sqrt(2).
    assert oracle.final_half_width == pytest.approx(12.706 * 0.028284 / math.sqrt(2), rel=1e-3)
    assert oracle.best_round == 2 and oracle.megabytes_down == pytest.approx(4.0)
    assert math.isnan(confidence_half_width([0.5]))


def test_the_best_round_under_sampling_is_one_every_client_scored():
    """Round 1 of each run was scored by a sample of 2 of 10 clients (clients-per-round), which happened
    to score high; the best round is the best that all 10 scored."""
    rows = [r for r in synthetic_rows() if r["num_clusters"] == "2" and r["method"] == "oracle"]
    for row in rows:
        sampled = row["round"] == "1"
        row |= {"clients_evaluated": "2" if sampled else "10", "accuracy": "0.99" if sampled else row["accuracy"]}
    extra = [row | {"round": "3", "clients_evaluated": "10", "accuracy": "0.5"} for row in rows if row["round"] == "2"]
    (oracle,) = summarise(rows + extra)
    assert (oracle.best_round, oracle.best_accuracy) == (2, pytest.approx(0.92))


def with_validation(rows: list[dict[str, str]], scores: dict[str, float]) -> list[dict[str, str]]:
    """The rows with a validation score per method whose order is the reverse of the test score's."""
    return [row | {"validation_accuracy": str(scores[row["method"]])} for row in rows]


def test_runs_with_validation_are_ranked_by_it_not_by_the_test_score():
    """Oracle leads on test; FedAvg on validation, which is what a choice reads."""
    rows = with_validation([r for r in synthetic_rows() if r["num_clusters"] == "2"], {"fedavg": 0.8, "oracle": 0.7})
    assert [s.method for s in summarise(rows)] == ["fedavg", "oracle"]
    assert "| rank (by validation) | method" in summary_table(summarise(rows))
    assert [s.method for s in summarise(synthetic_rows()[:8])] == ["oracle", "fedavg"]  # without: by test


def write_rows(folder: Path, rows: list[dict[str, str]]) -> None:
    with (folder / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_a_sweep_with_validation_has_each_table_on_validation_too(tmp_path):
    write_rows(tmp_path, with_validation(synthetic_rows(), {"fedavg": 0.8, "oracle": 0.7}))
    spec = TableSpec(columns=("num-clusters",), groups="dataset", title="E1")
    render(tmp_path, "E1 quick", "sweep", [spec], ["dataset", "scenario", "num_clusters"], [])
    tables = (tmp_path / "tables.md").read_text()
    test_part, validation_part = tables.split("## E1, on validation")
    assert "| oracle | **0.920 ± " in test_part
    assert "| fedavg | **0.800 ± 0.000** | **0.800 ± 0.000** |" in validation_part
    assert "| oracle | 0.700 ± 0.000 | 0.700 ± 0.000 |" in validation_part
    assert (tmp_path / "table-1-validation.png").stat().st_size > 10_000


def test_paper_table_puts_methods_down_and_k_across_with_the_best_in_bold():
    table = paper_table(synthetic_rows(), TableSpec(columns=("num-clusters",), groups="dataset"))
    lines = table.splitlines()
    assert lines[0] == "| method | mnist K=2 | mnist K=5 |"
    assert lines[2].startswith("| fedavg | 0.520 ± ") and "**" not in lines[2]
    assert lines[3].startswith("| oracle | **0.920 ± ") and lines[3].count("**") == 4


def test_sweep_reports_and_figures_come_from_the_tidy_file(tmp_path):
    write_rows(tmp_path, synthetic_rows())
    spec = TableSpec(columns=("num-clusters",), groups="dataset", title="E1")
    render(tmp_path, "E1 quick", "sweep", [spec], ["dataset", "scenario", "num_clusters"], [])
    tables = (tmp_path / "tables.md").read_text()
    assert "## E1" in tables and "![E1](table-1.png)" in tables
    assert (tmp_path / "table-1.png").stat().st_size > 10_000
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("| rank | method") == 2  # one ranked table and convergence plot per K
    assert "![convergence](convergence-2.png)" in summary and (tmp_path / "convergence-2.png").is_file()
    render(tmp_path, "compare", "compare", [], [], [])
    assert (tmp_path / "convergence.png").stat().st_size > 10_000


@pytest.mark.parametrize("grid", GRIDS, ids=lambda path: path.stem)
def test_every_grid_file_plans_at_full_size_and_has_a_quick_profile(grid):
    """A grid that reproduces paper tables runs the paper's protocol (20 rounds of 1 epoch; the
    appendix's tables, whose protocol the paper does not give, 20 rounds); every grid has a quick
    profile, a smaller check of the same pipeline."""
    import tomllib

    from fedcond.tools.paper import APPENDIX_TABLES

    full = plan(read_grid_file(grid), default_config(), Path("/nonexistent/runs"))
    quick = plan(read_grid_file(grid, "quick"), default_config(), Path("/nonexistent/runs"))
    assert 0 < len(quick) < len(full)
    tables = tomllib.loads(grid.read_text())["paper-tables"]
    if tables:
        main_paper = not set(tables) <= set(APPENDIX_TABLES)
        assert all(run.config.num_server_rounds == 20 and (run.config.local_epochs == 1 or not main_paper)
                   for run in full)  # fmt: skip
    assert all(run.config.data_fraction < 1 for run in quick)
    assert all(q.config.data_fraction < f.config.data_fraction for q, f in zip(quick, full, strict=False))


def test_the_fingerprint_study_grids_plan_the_studys_44_runs_with_held_out_clients():
    runs = [
        run
        for grid, profile in [(STUDY_GRIDS[0], None), (STUDY_GRIDS[0], "second-seed"), (STUDY_GRIDS[1], None)]
        for run in plan(read_grid_file(grid, profile), default_config(), Path("/nonexistent/runs"))
    ]
    assert [grid.stem for grid in STUDY_GRIDS] == ["fingerprints-e3b", "fingerprints-transfer"]
    assert len(runs) == 44 and all(run.config.held_out_clients == 1 for run in runs)
    assert all(run.config.num_server_rounds == 12 and run.config.data_fraction == 0.1 for run in runs)
    assert {run.config.method for run in runs} == {"fedavg", "oracle", "conditional"}


def test_paper_tables_show_held_out_accuracy_beside_each_column():
    rows = [
        {"variant": variant, "method": method, "experiment": "e1", "seed": "0", "round": "1", "dataset": "digits",
         "scenario": "label-shift", "num_clusters": "5", "clients_per_cluster": "3", "data_fraction": "0.1",
         "rotations": "", "fingerprint": "eigen", "conditioning": "hyper", "accuracy": accuracy,
         "heldout_accuracy": held}
        for variant, method, accuracy, held in [("fedavg", "fedavg", "0.6", "0.5"),
                                                ("eigen/hyper", "conditional", "0.9", "0.4")]
    ]  # fmt: skip
    table = paper_table(rows, TableSpec(columns=("experiment",), rows="variant"))
    header, _, *lines = table.splitlines()
    assert header == "| variant | experiment=e1 | experiment=e1 held-out |"
    assert lines[1] == "| eigen/hyper | **0.900** | 0.400 |"


def test_grid_file_errors_are_one_line_and_name_the_fix(tmp_path):
    with pytest.raises(FedcondError, match="no profile 'slow'"):
        read_grid_file(GRIDS[0], "slow")
    bad = tmp_path / "bad.toml"
    bad.write_text('[grid]\nmethod = ["fedavg"]\n[[table]]\ncolumns = ["num-clusters"]\n')
    with pytest.raises(FedcondError, match="table axis 'num-clusters' is not a grid axis"):
        read_grid_file(bad)
    bad.write_text('[grid]\nmethod = ["fedvg"]\n')
    with pytest.raises(FedcondError, match="unknown method 'fedvg'"):
        read_grid_file(bad)
    with pytest.raises(FedcondError, match="no grid file"):
        read_grid_file(tmp_path / "missing.toml")


def test_a_profile_that_extends_another_starts_from_its_keys_and_a_loop_is_refused(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(
        '[settings]\nseed = 0\n[grid]\nmethod = ["fedavg", "oracle"]\n'
        "[profiles.short]\nnum-server-rounds = 3\ndata-fraction = 0.2\n"
        '[profiles.short-oracle]\nextends = "short"\nmethod = ["oracle"]\ndata-fraction = 0.1\n'
    )
    experiment = read_grid_file(grid, "short-oracle")
    assert experiment.axes["method"] == ["oracle"]
    assert experiment.settings == {"seed": 0, "num-server-rounds": 3, "data-fraction": 0.1}
    grid.write_text('[grid]\nmethod = ["fedavg"]\n[profiles.a]\nextends = "b"\n[profiles.b]\nextends = "a"\n')
    with pytest.raises(FedcondError, match="profiles a -> b -> a extend each other in a loop"):
        read_grid_file(grid, "a")
    grid.write_text('[grid]\nmethod = ["fedavg"]\n[profiles.a]\nextends = "quik"\n')
    with pytest.raises(FedcondError, match="has no profile 'quik'"):
        read_grid_file(grid, "a")


def test_a_folder_that_two_profiles_ran_into_names_both_in_its_title(tmp_path):
    """A sweep of a second profile into a folder extends its experiment; its title keeps every profile
    the folder holds (the report's heading), where it used to keep only the last one's."""
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'title = "A grid"\n[settings]\nseed = 0\n[grid]\nmethod = ["fedavg", "oracle"]\n'
        '[profiles.first]\nmethod = ["fedavg"]\n[profiles.second]\nmethod = ["oracle"]\n'
        '[profiles.third]\nmethod = ["local"]\n'
    )
    out = tmp_path / "out"
    out.mkdir()
    for profile in ("first", "second", "first", "third"):
        record_experiment(read_grid_file(grid, profile), out)
    experiment = load_experiment(out)
    assert experiment.title == "A grid (profiles first, second and third)"
    assert experiment.axes["method"] == ["fedavg", "oracle", "local"]


def test_a_label_with_punctuation_names_its_folder_without_stray_hyphens():
    experiment = Experiment(
        {"num-clusters": 2, "clients-per-cluster": 2},
        {"variant": [{"label": "Global (pooled-global)", "method": "pooled-global"},
                     {"label": "CFL (authors' eps 0.4, 1.6)", "method": "cfl", "cfl-eps1": 0.4}], "seed": [0]},
    )  # fmt: skip
    names = [run.name for run in plan(experiment, default_config(), Path("/nonexistent/runs"))]
    assert names == ["variant-Global-pooled-global_seed-0", "variant-CFL-authors-eps-0.4-1.6_seed-0"]


def test_bundled_axis_values_set_several_keys_and_label_the_run():
    experiment = read_grid_file(next(g for g in GRIDS if g.stem == "e2b-rotation"), "quick")
    runs = plan(experiment, default_config(), Path("/nonexistent/runs"))
    c4 = [run for run in runs if run.labels["configuration"] == "C4"]
    assert c4 and all(run.config.rotations == "C4" and run.config.num_clusters == 4 for run in c4)
    assert c4[0].name.startswith("dataset-mnist_configuration-C4_method-")


@pytest.mark.slow
def test_compare_runs_two_methods_end_to_end(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main([
        "compare", "--num-clusters", "2", "--clients-per-cluster", "2", "--rounds", "2",
        "--methods", "fedavg,local", "--seeds", "0", "--out", str(out), "local-epochs=1",
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "| rank | method" in printed and "[2/2] method-local_seed-0" in printed
    with (out / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sorted({r["method"] for r in rows}) == ["fedavg", "local"] and len(rows) == 4
    assert (out / "convergence.png").is_file() and "| 1 |" in (out / "summary.md").read_text()
    # Local sends nothing; FedAvg moves the model both ways every round.
    assert all((int(r["bytes_down"]) > 0) == (r["method"] == "fedavg") for r in rows)


def test_dry_run_lists_the_runs_without_running_them(tmp_path, capsys):
    grid = next(g for g in GRIDS if g.stem == "e3b-k-sweep")
    assert main(["sweep", str(grid), "--profile", "quick", "--out", str(tmp_path / "o"), "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("todo  dataset-mnist_num-clusters-2_method-fedavg_seed-0  (10 clients, 10 rounds)")
    assert printed[-1] == "10 runs, 1750 client-rounds of training in all"
    assert not (tmp_path / "o" / "runs").exists()


def test_a_dry_runs_client_rounds_count_the_sample_a_round_trains_not_every_client(tmp_path, capsys):
    arguments = ["compare", "--methods", "fedavg", "--rounds", "4", "--out", str(tmp_path / "o"), "--dry-run"]
    assert main([*arguments, "clients-per-round=5", "held-out-clients=1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2] == "todo  method-fedavg_seed-0  (18 clients, 5 trained a round, 4 rounds)"
    assert printed[-1] == "1 runs, 20 client-rounds of training in all"


def test_heldout_accuracy_joins_the_tidy_file_and_summary_only_when_measured(tmp_path):
    experiment = small_experiment()
    run_experiment(experiment, default_config(), tmp_path / "plain", FakeRunner(), io.StringIO())
    with write_metrics(experiment, tmp_path / "plain").open() as handle:
        assert "heldout_accuracy" not in next(csv.reader(handle))
    experiment.settings["held-out-clients"] = 1
    experiment.axes["method"] = ["conditional"]
    run_experiment(experiment, default_config(), tmp_path / "held", FakeRunner(), io.StringIO())
    with write_metrics(experiment, tmp_path / "held").open() as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[-1]["heldout_accuracy"]) == pytest.approx(float(rows[-1]["accuracy"]) - 0.05)
    render(tmp_path / "held", "t", "compare", [], [], [])
    assert "held-out accuracy" in (tmp_path / "held" / "summary.md").read_text()


def test_tidy_rows_name_the_fingerprint_and_conditioning_even_of_runs_recorded_before_them(tmp_path):
    experiment = small_experiment()
    experiment.settings["fingerprint"] = "class-mean"
    run_experiment(experiment, default_config(), tmp_path, FakeRunner(), io.StringIO())
    with write_metrics(experiment, tmp_path).open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(row["fingerprint"], row["conditioning"]) for row in rows} == {("class-mean", "concat")}
    for run_json in tmp_path.glob("runs/*/run.json"):
        record = json.loads(run_json.read_text())
        del record["config"]["fingerprint"], record["config"]["conditioning"]
        run_json.write_text(json.dumps(record))
    experiment.settings.pop("fingerprint")  # the settings of a folder written before the setting existed
    with write_metrics(experiment, tmp_path).open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(row["fingerprint"], row["conditioning"]) for row in rows} == {("eigen", "concat")}


@pytest.mark.slow
def test_a_failure_at_the_set_up_step_fails_that_run_and_the_next_still_runs(tmp_path, monkeypatch, capsys):
    import fedcond.federation.secagg_workflow

    def broken_secure_sum(*_args: object) -> None:
        raise ValueError("the share step broke\n  on two lines")

    # The ServerApp runs in this process's thread, so the patch reaches the strategy's set-up step.
    monkeypatch.setattr(fedcond.federation.secagg_workflow, "run_secure_sum", broken_secure_sum)
    out = tmp_path / "cmp"
    code = main([
        "compare", "--num-clusters", "2", "--clients-per-cluster", "1", "--rounds", "1",
        "--methods", "conditional,fedavg", "--seeds", "0", "--out", str(out), "local-epochs=1",
    ])  # fmt: skip
    assert code == 1  # a run failed: the command says so, after running the rest
    failed = out / "runs" / "method-conditional_seed-0"
    info = json.loads((failed / "run.json").read_text())
    assert info["status"] == "failed" and info["error"] == "ValueError: the share step broke on two lines"
    assert "Traceback" not in (failed / "run.json").read_text()
    assert "Traceback" in (failed / "traceback.txt").read_text()  # kept beside it for whoever debugs
    assert run_status(out / "runs" / "method-fedavg_seed-0") == "finished"
    printed = capsys.readouterr()  # the reason once, in the run's progress line; Flower's lines in its log
    assert "method-conditional_seed-0 did not finish (failed: ValueError: the share step broke on two lines)" in (
        printed.out
    )
    assert "Traceback" not in printed.out + printed.err
    assert "the share step broke" in (failed / "flower.log").read_text()


def test_a_runner_that_raises_or_says_nothing_leaves_a_failed_run_and_the_grid_goes_on(tmp_path):
    class Raising(FakeRunner):
        def __call__(self, config: RunConfig) -> None:
            if config.method == "fedavg" or config.seed == 1:
                self.calls.append(config)
                if config.method == "fedavg":
                    raise RuntimeError("An error was encountered.\nEnding sim.")
                return  # stopped before writing run.json
            super().__call__(config)

    runner = Raising()
    run_experiment(small_experiment(), default_config(), tmp_path, runner, io.StringIO())
    assert len(runner.calls) == 4
    runs = tmp_path / "runs"
    assert run_status(runs / "method-fedavg_seed-0") == "failed: RuntimeError: An error was encountered. Ending sim."
    assert run_status(runs / "method-conditional_seed-1").startswith("failed: the run ended without finishing")
    assert run_status(runs / "method-conditional_seed-0") == "finished"


def test_a_folder_another_live_invocation_holds_is_refused_and_a_dead_ones_is_taken_over(tmp_path):
    refused = f"in use by another fedcond compare or sweep \\(process {os.getpid()}\\)"
    with experiment_lock(tmp_path), pytest.raises(FedcondError, match=refused), experiment_lock(tmp_path):
        pass
    with experiment_lock(tmp_path):  # released when its holder is done
        pass
    # Another process holds it: refused in one line, and nothing in the folder is touched.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from fedcond.tools.experiment import "
         "experiment_lock\nwith experiment_lock(Path(sys.argv[1])):\n print('held', flush=True); time.sleep(60)",
         str(tmp_path)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(FedcondError, match=f"\\(process {holder.pid}\\); wait for it") as error:
            run_experiment(small_experiment(), default_config(), tmp_path, FakeRunner(), io.StringIO())
        assert "\n" not in str(error.value) and not (tmp_path / "runs").exists()
    finally:
        holder.kill()
        holder.wait()
    # Its holder died without letting go: the lock is taken over.
    runner = FakeRunner()
    run_experiment(small_experiment(), default_config(), tmp_path, runner, io.StringIO())
    assert len(runner.calls) == 4


class ClassScoringRunner(FakeRunner):
    """A FakeRunner whose runs also record final per-class accuracies (per-class-accuracy), known
    functions of the method and seed: class "a" at 0.5 + seed/10, class "b" at 0.9 (conditional only)."""

    def __call__(self, config: RunConfig) -> None:
        super().__call__(config)
        folder = Path(config.results_dir) / config.run_name
        info = json.loads((folder / "run.json").read_text())
        classes = {"a": {"accuracy": 0.5 + config.seed / 10, "samples": 10}}
        if config.method == "conditional":
            classes["b"] = {"accuracy": 0.9, "samples": 5}
        info["final_class_accuracy"] = {"participants": classes, "newcomers": {}}
        (folder / "run.json").write_text(json.dumps(info))


def test_a_per_class_table_reads_each_runs_final_class_accuracies_and_leaves_the_other_tables_alone(tmp_path):
    from fedcond.tools.report import class_table

    experiment = small_experiment()
    run_experiment(experiment, default_config(), tmp_path, ClassScoringRunner(), io.StringIO())
    with write_metrics(experiment, tmp_path).open() as handle:
        rows = list(csv.DictReader(handle))
    finals = [row for row in rows if row["round"] == "3"]
    assert all(row["class:a"] != "" for row in finals) and all(
        row["class:a"] == "" for row in rows if row["round"] != "3"
    )
    table = class_table(rows, TableSpec(classes=("a", "b", "c")))
    assert table.splitlines()[0] == "| class | fedavg | conditional |"
    assert table.splitlines()[2].startswith("| a | 0.550") and table.splitlines()[2].count("0.550") == 2  # seeds 0, 1
    assert table.splitlines()[3] == "| b | — | 0.900 ± 0.000 |" and table.splitlines()[4] == "| c | — | — |"
    # The per-class cells do not split a run in two: the ordinary table still has one final row per seed.
    assert "| fedavg | 0.325 ± 0.064 |" in paper_table(rows, TableSpec(rows="method"))  # 0.32 + 0.01 x seed, seeds 0, 1


def test_a_per_class_table_of_emnist_runs_puts_table_ix_beside_each_character():
    from fedcond.tools.report import class_table

    def final(method: str, accuracy: float, **extra: str) -> dict[str, str]:
        return {"dataset": "emnist-byclass", "method": method, "seed": "0", "round": "20", "accuracy": "0.9",
                "class:o": str(accuracy), "class:Q": "0.5", **extra}  # fmt: skip

    rows = [final("fedavg", 0.1), final("conditional", 0.8, fingerprint="eigenvector"), final("ifca", 0.7)]
    table = class_table(rows, TableSpec(classes=("o", "Q")))
    # Table IX: o (lower) Global .000, Conditional .917; IFCA has no column; Q is not a character of it.
    assert table.splitlines()[2] == "| o | 0.100 (paper 0.000) | 0.800 (paper 0.917) | 0.700 |"
    assert "paper" not in table.splitlines()[3]
    mnist = [{**row, "dataset": "mnist"} for row in rows]
    assert "paper" not in class_table(mnist, TableSpec(classes=("o",)))


def test_a_bundle_changed_under_its_label_replaces_the_old_one_once_its_run_is_redone(tmp_path):
    """A grid's bundle keeps its label with other settings (a learning rate fixed): its finished run
    is refused until its folder is deleted; the sweep that redoes it leaves one bundle of that label
    in experiment.json (the new one, in the old one's place), so the folder reports."""
    import shutil

    def experiment(rate: float) -> Experiment:
        bundles = [
            {"label": "slow", "method": "fedavg", "learning-rate": rate},
            {"label": "oracle", "method": "oracle"},
        ]
        return Experiment({"num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 2},
                          {"variant": bundles, "seed": [0]})  # fmt: skip

    run_experiment(experiment(0.01), default_config(), tmp_path, FakeRunner(), io.StringIO())
    with pytest.raises(FedcondError, match="holds a finished run with other settings"):
        run_experiment(experiment(0.001), default_config(), tmp_path, FakeRunner(), io.StringIO())
    shutil.rmtree(tmp_path / "runs" / "variant-slow_seed-0")
    run_experiment(experiment(0.001), default_config(), tmp_path, FakeRunner(), io.StringIO())
    recorded = json.loads((tmp_path / "experiment.json").read_text())["axes"]["variant"]
    assert [bundle["label"] for bundle in recorded] == ["slow", "oracle"] and recorded[0]["learning-rate"] == 0.001
    assert len(list(tidy_rows(load_experiment(tmp_path), tmp_path))) == 2 * 2  # two runs of two rounds


def test_a_sweeps_summary_ranks_the_variants_of_a_method_axis_together_under_their_labels(tmp_path):
    """A variant axis (bundles naming a method) tells runs apart, as methods do: one scenario point,
    one ranked table whose rows are the variants' labels, not a section per variant."""
    bundles = [{"label": "plain", "method": "fedavg"}, {"label": "told", "method": "oracle"}]
    experiment = Experiment({"num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 3},
                            {"variant": bundles, "seed": [0]})  # fmt: skip
    run_experiment(experiment, default_config(), tmp_path, FakeRunner(), io.StringIO())
    assert experiment.method_axes == ["variant"] and "variant" not in experiment.point_axes
    main(["report", str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("\n## ") == 1 and "| 1 | told |" in summary and "| 2 | plain |" in summary
    assert (tmp_path / "convergence-1.png").is_file() and not (tmp_path / "convergence-2.png").exists()


def test_a_parallel_in_process_compare_runs_every_run_in_processes_of_its_own_as_the_sequential_one(tmp_path, capsys):
    arguments = ["compare", "--num-clusters", "2", "--clients-per-cluster", "2", "--rounds", "2", "--seeds", "0,1",
                 "--methods", "fedavg,recommended", "local-epochs=1", "--runner", "in-process"]  # fmt: skip
    assert main([*arguments, "--out", str(tmp_path / "one")]) == 0
    assert main([*arguments, "--parallel", "2", "--out", str(tmp_path / "two")]) == 0
    printed = capsys.readouterr().out
    assert "fedcond: [4/4]" in printed and "finished" in printed
    finals = {}
    for name in ("one", "two"):
        with (tmp_path / name / "metrics.csv").open() as handle:
            rows = list(csv.DictReader(handle))
        finals[name] = {(r["method"], r["seed"], r["round"]): round(float(r["accuracy"]), 3) for r in rows}
    assert len(finals["two"]) == 8 and finals["two"] == finals["one"]


def test_parallel_runs_need_the_in_process_runner(tmp_path, capsys):
    arguments = ["compare", "--methods", "fedavg", "--out", str(tmp_path / "o"), "--parallel", "2"]
    assert main(arguments) == 2
    assert "add --runner in-process or drop --parallel" in capsys.readouterr().err


class TimedRunner(FakeRunner):
    """Rounds of a known length (the history's ``seconds``: 5 s) written at once; the first run
    fails after 2 of its 10 rounds."""

    def __call__(self, config: RunConfig) -> None:
        recorder = RunRecorder(results_folder(config), config.resolved(), {}, config.num_clusters)
        for number in range(1, 3 if config.seed == 0 else config.num_server_rounds + 1):
            recorder.add(RoundRecord(number, 0.5, 1.0, 1.0, 5.0, 5.0 * number, 1000, 500))
        if config.seed == 0:
            recorder.fail("training loss became nan in round 3; lower learning-rate")
        else:
            recorder.finish()


def test_the_time_left_counts_rounds_at_their_own_length_and_drops_a_failed_runs_unrun_rounds(tmp_path):
    """Two runs of 10 rounds of 5 s; the first fails at round 3. Then 9 rounds are left after the
    second run's first: 45 s, whatever the wall clock of these instant fake runs says."""
    stream = io.StringIO()
    experiment = Experiment({"num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 10},
                            {"method": ["fedavg"], "seed": [0, 1]}, kind="compare")  # fmt: skip
    run_experiment(experiment, default_config(), tmp_path, TimedRunner(), stream)
    lines = [line for line in stream.getvalue().splitlines() if "| about" in line]
    assert lines[0].endswith("round 1/10 accuracy 0.5000 | about 2 min left")  # 19 rounds of 5 s: 95 s
    assert "[2/2] method-fedavg_seed-1: round 1/10 accuracy 0.5000 | about 45 s left" in lines[2]
    assert lines[-1].endswith("round 10/10 accuracy 0.5000 | about 0 s left")
