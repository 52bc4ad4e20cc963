"""The paper's numbers: the matcher on known cells, the paper column of the reports, the reproduction report."""

import csv
import json
from pathlib import Path

import pytest

from fedcond.tools.cli import main
from fedcond.tools.experiment import Experiment, TableSpec
from fedcond.tools.paper import (
    DATASETS,
    DOMAIN_DATASET,
    EMNIST_EXPERIMENT,
    EXPERIMENTS,
    METHODS,
    PaperCell,
    load_cells,
    lookup,
    paper_csv,
)
from fedcond.tools.report import paper_table, render
from fedcond.tools.report import summary_markdown as compare_summary


def ours(**settings: str) -> dict[str, str]:
    """A tidy row of one of our runs: MNIST E1 K=5 x 5 clients, the paper's conditional, unless told."""
    row = {
        "dataset": "mnist", "scenario": "label-shift", "num_clusters": "5", "clients_per_cluster": "5",
        "data_fraction": "1.0", "rotations": "", "fingerprint": "eigen", "conditioning": "concat",
        "method": "conditional",
    }  # fmt: skip
    return {**row, **settings}


def test_the_csv_is_found_from_the_package_and_holds_only_results_cells():
    assert paper_csv().parts[-3:] == ("experiments", "paper", "results.csv")
    cells = load_cells()
    assert len(cells) > 1000
    # Derived rows (Table III's Δ and Mean, Table V's relative change) are not results; Table IX's
    # per-character cells are read apart (character_cells).
    assert not {cell.method for cell in cells} & {"Cond-Oracle", "Cond"}
    assert {cell.experiment for cell in cells} == {*EXPERIMENTS.values(), EMNIST_EXPERIMENT}
    assert "IX" not in {cell.table for cell in cells} and {
        cell.configuration for cell in cells if cell.table == "VIII"
    } == {f"n_c={n}" for n in (0, 1, 2, 3, 4, 8)}


def test_every_name_we_map_to_is_spelled_as_in_the_csv():
    cells = load_cells()
    assert set(DATASETS.values()) | {DOMAIN_DATASET} <= {cell.dataset for cell in cells}
    assert set(METHODS.values()) <= {cell.method for cell in cells}


def test_known_cells():
    match = lookup(ours())
    assert match.value == 1.00 and match.tables == ("II", "X") and not match.reason
    match = lookup(ours(scenario="concept-permutation", num_clusters="2", method="oracle"))
    assert match.value == 0.992 and match.tables == ("IV", "XVII", "XVIII")
    assert lookup(ours(scenario="concept-permutation", num_clusters="2", method="fedavg")).others == (
        (0.494, ("XVIII",)),
    )


@pytest.mark.parametrize("dataset", ["mnist", "fashion-mnist"])
def test_domain_shift_is_the_paper_mnist_plus_fmnist_whichever_source_names_the_run(dataset):
    row = ours(scenario="domain", dataset=dataset, num_clusters="2")
    match = lookup(row)
    assert match.value == 0.955 and match.tables == ("I", "XIX")
    # E4a's Sparse level is 25 clients per cluster (E1-E3's is 20).
    assert lookup({**row, "clients_per_cluster": "25"}).value == 0.956
    assert not lookup({**row, "clients_per_cluster": "20"}).found
    assert lookup(ours(num_clusters="2", clients_per_cluster="20")).tables == ("XI",)


@pytest.mark.parametrize("rotations", ["C3", "c3", "", "0,90,180,270"])
def test_rotation_set_c3_also_matches_table_one_whose_label_says_k4(rotations):
    row = ours(scenario="covariate-rotation", dataset="fashion-mnist", num_clusters="4", rotations=rotations)
    match = lookup({**row, "method": "fedavg"})
    assert match.value == 0.789 and match.tables == ("I", "XV")
    assert any("5 assumed" in note for note in match.notes) and any("C3" in note for note in match.notes)
    assert lookup({**row, "rotations": "C4"}).value == 0.903  # the other K=4 set has its own numbers


def test_unstated_clients_per_cluster_are_matched_by_five_only():
    row = ours(scenario="covariate-rotation", num_clusters="2", rotations="C1", clients_per_cluster="10")
    assert not lookup(row).found and "prints no" in lookup(row).reason
    assert lookup({**row, "clients_per_cluster": "5"}).value == 0.990


def test_duplicate_cells_prefer_the_value_most_tables_print_then_the_first_table():
    match = lookup(ours(dataset="fashion-mnist", num_clusters="2", method="oracle"))
    assert (match.value, match.tables, match.others) == (0.937, ("II", "X"), ((0.938, ("XI",)),))
    # Two tables each (II and X against V and XI): the first printed wins, the other is kept.
    match = lookup(ours(dataset="cifar10", num_clusters="2", method="fedavg"))
    assert (match.value, match.tables, match.others) == (0.735, ("II", "X"), ((0.709, ("V", "XI")),))
    # E4b C=2: Tables III and XX print .920 without clients per cluster, XXI .919 with 5.
    match = lookup(ours(scenario="combined", dataset="cifar10", num_clusters="4"))
    assert (match.value, match.tables) == (0.92, ("III", "XX"))


def test_a_value_printed_by_more_tables_beats_the_first_printed_one():
    # No setting of the real CSV tells the two rules apart, so three made-up printings do.
    cells = tuple(
        PaperCell(table, "E1", "MNIST", 5, 5, "", "Conditional", value)
        for table, value in (("II", 0.90), ("X", 0.91), ("XI", 0.91))
    )
    match = lookup(ours(), cells)
    assert (match.value, match.tables, match.others) == (0.91, ("X", "XI"), ((0.90, ("II",)),))


def test_the_pooled_family_maps_onto_the_paper_columns():
    assert lookup(ours(method="pooled-conditional")).value == 1.00
    assert lookup(ours(method="pooled-oracle")).value == 0.999
    assert lookup(ours(method="pooled-global")).value == lookup(ours(method="fedavg")).value == 0.933


def test_our_variants_and_datasets_the_paper_lacks_have_no_counterpart():
    variant = lookup(ours(fingerprint="class-mean"))
    assert not variant.found and "class-mean" in variant.reason and "variant" in variant.reason
    assert not lookup(ours(method="pooled-conditional", conditioning="hyper")).found
    # The fingerprint of a method that takes none does not matter.
    assert lookup(ours(method="oracle", fingerprint="class-mean")).value == 0.999
    assert lookup(ours(dataset="digits")).reason == "the paper has no digits results"
    assert not lookup(ours(num_clusters="7")).found
    # Rows of a metrics.csv older than the fingerprint column ran the paper's method.
    old = {key: value for key, value in ours().items() if key not in ("fingerprint", "conditioning")}
    assert lookup(old).value == 1.00


def metrics_rows(data_fraction: str = "0.1") -> list[dict[str, str]]:
    """Two seeds of three methods on MNIST E1 K=5, and one digits run, with known final accuracies."""
    finals = {"conditional": [0.90, 0.92], "fedavg": [0.50, 0.50], "pooled-conditional": [0.95, 0.95]}
    rows = []
    for method, accuracies in finals.items():
        for seed, final in enumerate(accuracies):
            for number in (1, 2):
                rows.append({
                    **ours(method=method, data_fraction=data_fraction), "seed": str(seed), "round": str(number),
                    "fingerprint": "class-mean" if method == "pooled-conditional" else "eigen",
                    "accuracy": str(final if number == 2 else final / 2), "loss": "1", "seconds": "2",
                    "bytes_down": "1000", "bytes_up": "1000", "ari": "nan", "train_loss": "1",
                    "elapsed_seconds": str(60 * number),
                })  # fmt: skip
    return rows


def write_rows(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_the_summary_shows_the_paper_and_our_difference_and_says_what_has_none(tmp_path):
    write_rows(tmp_path / "metrics.csv", metrics_rows())
    printed = render(tmp_path, "E1", "compare", [], [], [])
    assert "| paper | Δ vs paper |" in printed
    assert "| 2 | conditional | 2 | 0.910 ± 0.127 | 1.000 | -9.0 |" in printed
    assert "| 3 | fedavg | 2 | 0.500 ± 0.000 | 0.933 | -43.3 |" in printed
    assert "| 1 | pooled-conditional | 2 | 0.950 ± 0.000 | — | — |" in printed
    summary = (tmp_path / "summary.md").read_text()
    assert "no paper counterpart for pooled-conditional" in summary and "class-mean" in summary
    assert "data-fraction 0.1" in summary  # the paper's numbers are full-data: said beside the comparison


def test_full_data_needs_no_budget_warning_and_digits_gets_no_paper_column():
    rows = metrics_rows(data_fraction="1.0")
    assert "full-data" not in compare_summary(rows, "t")
    digits = compare_summary([{**row, "dataset": "digits"} for row in rows], "t")
    assert "| paper |" not in digits and "No paper counterpart for" in digits and "no digits results" in digits


def test_methods_at_a_point_the_paper_never_ran_share_one_legend_line():
    # CIFAR-10 under rotation: the paper ran E2b on Fashion-MNIST only, so no method has a cell there.
    rows = [
        {**row, "dataset": "cifar10", "scenario": "covariate-rotation", "num_clusters": "4", "rotations": "C3"}
        for row in metrics_rows(data_fraction="1.0")
    ]
    legend = [line for line in compare_summary(rows, "t").splitlines() if "counterpart" in line]
    assert legend == [
        "- No paper counterpart for conditional, fedavg: the paper prints no E2b CIFAR-10 C3 K=4 x 5 clients results.",
        "- No paper counterpart for pooled-conditional: pooled-conditional with fingerprint class-mean and "
        "conditioning concat is our variant (the paper's is eigen + concat).",
    ]
    # Where the paper has the point but not the method, the reason still names the missing cell.
    cells = (PaperCell("II", "E1", "MNIST", 5, 5, "", "FedAvg", 0.9),)
    assert lookup(ours(method="oracle"), cells).reason == "the paper prints no E1 MNIST K=5 x 5 clients Oracle cell"


def test_paper_table_cells_carry_the_paper_number():
    rows = metrics_rows() + [{**row, "num_clusters": "2"} for row in metrics_rows()]
    table = paper_table(rows, TableSpec(columns=("num-clusters",), groups="dataset"))
    assert "| conditional | 0.910 ± 0.127 (paper 0.996, -8.6) | 0.910 ± 0.127 (paper 1.000, -9.0) |" in table
    assert "0.950 ± 0.000** (paper —)" in table


def results_folder(folder: Path, rows: list[dict[str, str]]) -> Path:
    folder.mkdir(parents=True)
    experiment = Experiment({"data-fraction": 0.1}, {"method": ["conditional", "fedavg"], "seed": [0, 1]},
                            title="E1 quick", kind="compare")  # fmt: skip
    (folder / "experiment.json").write_text(json.dumps(experiment.to_json()))
    write_rows(folder / "metrics.csv", rows)
    (folder / "convergence.png").write_bytes(b"png")
    return folder


def test_reproduction_links_the_notes_then_writes_the_tables(tmp_path, capsys):
    folder = results_folder(tmp_path / "results" / "e1", metrics_rows())
    notes = tmp_path / "reproduction-notes.md"
    notes.write_text("# Reproduction\n\nHand-written *discussion* | kept as is.\n")
    out = tmp_path / "REPRODUCTION.md"
    assert main(["reproduction", str(folder), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("<!-- generated by fedcond reproduction") and "do not edit" in text.splitlines()[0]
    # The notes are linked, never copied: each text has one home.
    assert "Hand-written" not in text and "[reproduction-notes.md](reproduction-notes.md)" in text
    assert "| conditional | 0.910 ± 0.127 | 1.000 | -9.0 | 2 | 2 min |" in text
    assert "![convergence](results/e1/convergence.png)" in text and "rounds of" not in text
    assert str(tmp_path) not in text  # links are relative: no machine's paths in the report
    assert main(["reproduction", str(folder), "--out", str(out)]) == 0  # a generated file is regenerated
    assert out.read_text() == text


def test_reproduction_shows_held_out_clients_when_measured(tmp_path, capsys):
    """The describe-or-memorise question: held-out accuracy sits beside the training clients'."""
    rows = [{**row, "heldout_accuracy": "0.12" if row["method"] == "conditional" else "0.5"} for row in metrics_rows()]
    folder = results_folder(tmp_path / "results" / "e3b", rows)
    notes = tmp_path / "reproduction-notes.md"
    notes.write_text("# Notes\n")
    out = tmp_path / "REPRODUCTION.md"
    assert main(["reproduction", str(folder), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| method | ours | paper | Δ | held-out clients | seeds | time per run |" in text
    assert "| conditional | 0.910 ± 0.127 | 1.000 | -9.0 | 0.120 | 2 | 2 min |" in text


def test_reproduction_puts_the_variants_of_one_scenario_point_in_one_table(tmp_path, capsys):
    """A grid axis beyond the standard settings (here the fingerprint's encoder) is a column each."""
    encoders = {"pixels": 0.0, "cifar10-reserved": -0.1}
    rows = [
        {**row, "fingerprint_encoder": encoder, "accuracy": str(float(row["accuracy"]) + shift)}
        for encoder, shift in encoders.items()
        for row in metrics_rows()
        if encoder == "pixels" or row["method"] != "fedavg"  # one variant did not run every method
    ]
    folder = results_folder(tmp_path / "results" / "encoders", rows)
    experiment = Experiment({"data-fraction": 0.1}, {"fingerprint-encoder": [*encoders],
                            "method": ["conditional", "fedavg", "pooled-conditional"], "seed": [0, 1]},
                            title="Encoders", kind="sweep")  # fmt: skip
    (folder / "experiment.json").write_text(json.dumps(experiment.to_json()))
    for number in (1, 2):
        (folder / f"convergence-{number}.png").write_bytes(b"png")
    (tmp_path / "reproduction-notes.md").write_text("# Notes\n")
    out = tmp_path / "REPRODUCTION.md"
    assert main(["reproduction", str(folder), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.count("#### ") == 1 and "#### mnist, label-shift, K=5 x 5 clients, data-fraction 0.1\n" in text
    assert "| method | paper | fingerprint_encoder=pixels | fingerprint_encoder=cifar10-reserved | seeds |" in text
    assert "| conditional | 1.000 | 0.910 ± 0.127 (-9.0) | 0.810 ± 0.127 (-19.0) | 2 |" in text
    assert "| fedavg | 0.933 | 0.500 ± 0.000 (-43.3) | not run | 2 |" in text
    assert "| pooled-conditional | — | 0.950 ± 0.000 | 0.850 ± 0.000 | 2 |" in text
    assert text.count("![convergence (fingerprint_encoder=") == 2


def test_reproduction_errors_name_the_fix(tmp_path, capsys):
    folder = results_folder(tmp_path / "e1", metrics_rows())
    out = tmp_path / "REPRODUCTION.md"
    assert main(["reproduction", str(folder), "--out", str(out)]) == 2
    assert "no notes file" in capsys.readouterr().err
    (tmp_path / "reproduction-notes.md").write_text("notes\n")
    out.write_text("# Typed by hand\n")
    assert main(["reproduction", str(folder), "--out", str(out)]) == 2
    assert "written by hand; move its prose into" in capsys.readouterr().err
    assert out.read_text() == "# Typed by hand\n"
    out.unlink()
    (folder / "metrics.csv").unlink()
    assert main(["reproduction", str(folder), "--out", str(out)]) == 2
    assert "holds no metrics.csv; run fedcond report" in capsys.readouterr().err
    assert main(["reproduction", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "holds no experiment.json" in capsys.readouterr().err


GRIDS = sorted(Path(__file__).resolve().parents[1].joinpath("experiments", "grids").glob("*.toml"))


@pytest.mark.parametrize("grid", GRIDS, ids=lambda path: path.stem)
def test_every_grid_that_claims_paper_tables_runs_their_settings(grid, tmp_path):
    """A grid names the tables it reproduces (``paper-tables``; ``[]``: none), and each of its
    configurations of a paper method, in the full grid and in every profile, is a cell of one of
    them: a grid cannot drift from the paper's settings (E4b's C, the sparsity tables' K) unnoticed."""
    import tomllib

    from fedcond.tools.experiment import plan, read_grid_file
    from fedcond.tools.paper import paper_setting

    data = tomllib.loads(grid.read_text())
    assert "paper-tables" in data, f"{grid.name} names no paper-tables (write [] for a grid that reproduces none)"
    claimed = set(data["paper-tables"])
    assert claimed <= {cell.table for cell in load_cells()}, f"{grid.name}: unknown tables {claimed}"
    if not claimed:
        return
    for profile in [None, *data.get("profiles", {})]:
        for run in plan(read_grid_file(grid, profile), {}, tmp_path):
            mapping = run.config.to_mapping()
            row = {key.replace("-", "_"): mapping[key] for key in
                   ("dataset", "scenario", "num-clusters", "clients-per-cluster", "rotations", "fingerprint",
                    "conditioning", "fingerprint-dim")}  # fmt: skip
            row["method"] = run.labels.get("method", run.config.method)
            setting = paper_setting(row)
            if isinstance(setting, str):
                continue  # our variants, datasets the paper lacks: no published number to meet
            match = lookup(row)
            printed_in = {*match.tables, *(table for _, tables in match.others for table in tables)}
            assert printed_in & claimed, (
                f"{grid.name} profile {profile}: {setting.describe()} is in no table of {claimed}"
            )


def test_the_sparse_column_is_met_by_25_clients_per_cluster_with_a_note():
    match = lookup(ours(num_clusters="2", clients_per_cluster="25"))
    assert match.value == 0.996 and match.tables == ("XI",)
    assert any("caption says 20" in note for note in match.notes)
    assert not any("caption" in note for note in lookup(ours(num_clusters="2", clients_per_cluster="20")).notes)
    assert not lookup(ours(num_clusters="2", clients_per_cluster="30")).found


@pytest.mark.parametrize("profile", [None, "mnist"])
def test_the_parameter_matched_controls_are_the_recommended_variants_size(profile, tmp_path):
    """Every conditioned control of parameter-matched.toml is within 0.5% of recommended's parameters."""
    from fedcond.data.datasets import dataset_spec
    from fedcond.model.networks import build_run_model, count_parameters
    from fedcond.tools.experiment import plan, read_grid_file

    grid = Path(__file__).resolve().parents[1] / "experiments" / "grids" / "parameter-matched.toml"
    sizes = {}
    for run in plan(read_grid_file(grid, profile), {}, tmp_path):
        if run.config.method == "conditional":
            classes = dataset_spec(run.config.dataset).num_classes
            sizes[run.labels["method"]] = count_parameters(build_run_model(run.config, classes, conditioned=True))
    target = sizes.pop("recommended")
    assert set(sizes) == {"conditional", "hyper-random-id", "concat-wide", "class-mean-concat-wide"}
    assert sizes.pop("conditional") < target / 1.05  # the paper's own network is the smaller one
    assert all(abs(size - target) / target < 0.005 for size in sizes.values()), (target, sizes)


def test_emnist_runs_meet_table_viii_by_the_number_of_eigenvectors_they_read():
    base = {"dataset": "emnist-balanced", "scenario": "label-shift", "num_clusters": 3, "clients_per_cluster": 10}
    cond = {**base, "method": "conditional", "fingerprint": "eigenvector", "conditioning": "concat"}
    assert lookup({**base, "method": "oracle"}).value == 0.969  # the references: n_c = 0
    assert [lookup({**cond, "fingerprint_dim": str(n)}).value for n in (1, 2, 3, 4, 8)] == [
        0.967,
        0.967,
        0.966,
        0.966,
        0.966,
    ]
    assert "no MCDC-EMNIST EMNIST-Balanced n_c=32" in lookup(cond).reason  # the default 32: no such row
    assert "our variant" in lookup({**cond, "fingerprint": "eigen"}).reason
    assert "2,500 samples a client" in lookup({**base, "method": "fedavg"}).notes[0]
    appendix = {
        "dataset": "synthetic-logistic",
        "scenario": "concept-weights",
        "num_clusters": 3,
        "clients_per_cluster": 100,
        "method": "conditional",
        "fingerprint": "eigenvector",
        "conditioning": "lin",
    }
    assert lookup({**appendix, "fingerprint_dim": "1"}).value == 0.964
    assert "first eigenvector (fingerprint-dim=1), not 2" in lookup({**appendix, "fingerprint_dim": "2"}).reason


def test_a_mean_some_seeds_did_not_measure_says_over_how_many_and_a_table_says_its_n():
    # Seed 0's runs predate the worst-client column: the mean is seed 1's alone, and says so.
    rows = [{**row, "worst_accuracy": "" if row["seed"] == "0" else "0.25"} for row in metrics_rows()]
    summary = compare_summary(rows, "t")
    assert "| 2 | conditional | 2 | 0.910 ± 0.127 | 1.000 | -9.0 | 0.250 (1 of 2 seeds) |" in summary
    # The paper-layout table: n a cell, and the cells with fewer named.
    from fedcond.tools.report import seeds_lines

    spec = TableSpec(columns=("num-clusters",), groups="dataset")
    assert seeds_lines(metrics_rows(), spec) == ["n: 2 seeds a cell."]
    fewer = [row for row in metrics_rows() if not (row["method"] == "fedavg" and row["seed"] == "1")]
    assert seeds_lines(fewer, spec) == ["n: 2 seeds a cell; fewer in fedavg, mnist K=5 (1)."]


def test_a_paired_verdict_follows_the_interval():
    from fedcond.tools.report import paired_verdict

    assert paired_verdict([1.0, 1.2, 0.9]) == "above"
    assert paired_verdict([-1.0, -1.2, -0.9]) == "below"
    # E4b's control, Conditional minus Oracle over seeds 0-2 (points): +1.13 +- 3.69.
    assert paired_verdict([0.31, 0.24, 2.85]) == "not established at 3 seeds"
    assert paired_verdict([5.0]) == "not established at 1 seed"
