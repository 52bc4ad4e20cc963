"""The `fedcond` command: bad input stops with one line before Flower starts (the real `flwr run`: test_resume)."""

from pathlib import Path

import pytest

from fedcond.tools.cli import main
from tests.test_datasets import write_fake_mnist


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["method=no-such-method"], "unknown method 'no-such-method'"),
        (["dataset=cifar7"], "unknown dataset 'cifar7'"),
        (["scenario=drift"], "unknown scenario 'drift'"),
        (["num-clusters=11"], "lower num-clusters"),
        (["num-clustres=2"], "unknown run-config key"),
        (["dataset=mnist", "data-dir=/nonexistent/folder"], "does not exist"),
        (["clients-per-cluster=500"], "lower clients-per-cluster"),
        (["newcomer-steps=3"], "newcomer-steps=3 fine-tunes what held-out clients are served, and this run has none"),
        (["fingerprint=class-mean", "normalisation=log"], "use normalisation=federated or none"),
        (["seed=-1"], "seed must be an integer in 0..4294967295 (got -1)"),
        (["learning-rate=inf"], "learning-rate must be positive and finite (got inf)"),
        (["learning-rate=nan"], "learning-rate must be positive and finite (got nan)"),
        (["momentum=1"], "momentum must be in [0, 1) (got 1.0)"),
        (["fingerprint-dim=100000"], "fingerprint-dim must be at most 1024"),
        (["run-name=../../x"], "run-name '../../x' must be a plain folder name"),
    ],
)
def test_bad_input_gives_one_line_and_exit_code_2(capsys, settings, message):
    assert main(["run", *settings]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedcond: error:") and message in err


@pytest.mark.parametrize(
    ("words", "command"),
    [
        (["settings", "--write"], "python -m tools.docs"),
        (["reproduction", "results", "--out", "R.md", "--readme", "README.md"], "python -m tools.reproduction"),
        (["reproduction", "results", "--out", "R.md", "--readme"], "python -m tools.reproduction"),
        (["reproduction", "results", "--claims", "paper/claims.toml", "--out", "R.md"], "python -m tools.reproduction"),
    ],
)
def test_an_option_that_moved_to_the_checkouts_tools_names_the_command_that_has_it(tmp_path, monkeypatch, capsys,
                                                                                   words, command):  # fmt: skip
    """The record tooling left the installed command (tools/, run from a checkout): the old options get
    one line naming the new command, not argparse's usage, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    assert main(words) == 2
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1 and printed.err.startswith("fedcond: error:") and command in printed.err
    assert not printed.out and list(tmp_path.iterdir()) == []


def test_missing_and_corrupt_data_files_are_reported_before_training(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["run", "dataset=mnist", f"data-dir={tmp_path / 'empty'}"]) == 2
    assert "no mnist idx files" in capsys.readouterr().err
    write_fake_mnist(tmp_path / "mnist")
    labels = tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:-9])
    assert main(["run", "dataset=mnist", f"data-dir={tmp_path}"]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err


def test_compare_plans_newcomers_for_every_method(tmp_path, capsys):
    """Every federated method serves a newcomer by its own rule (fedcond.newcomers): nothing is refused."""
    from fedcond.federation.methods import method_names

    out = tmp_path / "cmp"
    assert main(["compare", "--out", str(out), "--rounds", "1", "--dry-run", "held-out-clients=1"]) == 0
    listed = capsys.readouterr().out
    for method in method_names("all"):
        assert f"method-{method}" in listed, method


def test_a_methods_own_setting_in_a_compare_is_for_the_methods_that_read_it(tmp_path, capsys):
    """``ifca-models=3`` beside IFCA is IFCA's; where no method of the compare reads it, it is refused."""
    assert (
        main(["compare", "--methods", "fedavg,ifca", "--out", str(tmp_path / "a"), "--dry-run", "ifca-models=3"]) == 0
    )
    assert main(["compare", "--methods", "fedavg,local", "--out", str(tmp_path / "b"), "--dry-run",
                 "ifca-models=3"]) == 2  # fmt: skip
    assert "ifca-models=3 is a setting of ifca, and fedavg does not read it" in capsys.readouterr().err


def test_a_selection_leaves_out_a_method_that_cannot_run_the_settings_and_says_why(tmp_path, capsys, monkeypatch):
    """``--methods competitors`` names every competitor; one whose checks refuse the run (FedBN without
    batch norm) is left out with its reason and off the method axis. Named, it is refused."""
    from fedcond.errors import FedcondError
    from fedcond.federation.methods import method_names, registry

    classes = [method.strategy for method in registry().values()]
    refusing = next(name for name in method_names("competitors") if classes.count(registry()[name].strategy) == 1)

    def refuse(cls, config):
        raise FedcondError("cannot run these settings")

    monkeypatch.setattr(registry()[refusing].strategy, "check", classmethod(refuse))
    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "fedavg,competitors", "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert f"left out: {refusing} (from --methods competitors) cannot run here: cannot run these settings" in printed
    planned = {line.split("method-")[1].split("_")[0] for line in printed.splitlines() if line.startswith("todo")}
    left_out = {line.split()[2] for line in printed.splitlines() if line.startswith("left out:")}
    assert refusing in left_out and planned == {"fedavg", *method_names("competitors")} - left_out
    assert main(["compare", "--methods", f"fedavg,{refusing}", "--out", str(tmp_path / "named"), "--dry-run"]) == 2
    assert "cannot run these settings" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[1].joinpath("experiments").glob("*.toml")))
def test_every_experiment_file_is_a_valid_configuration(path):
    from fedcond.federation.checks import check_run
    from fedcond.federation.methods import run_config
    from fedcond.tools.flwr_commands import default_config, read_override_file

    overrides = read_override_file(str(path))
    assert overrides, f"{path.name} sets nothing"
    check_run(run_config({**default_config(), **overrides}))


def test_missing_experiment_file_is_reported(capsys):
    assert main(["run", "--config", "experiments/nope.toml"]) == 2
    assert "no experiment file" in capsys.readouterr().err


def test_a_named_variant_is_a_method_name_that_fixes_its_settings(tmp_path, capsys):
    """method=recommended is conditional with class-mean + hyper (scaled, from zero) wherever a method
    name goes; a setting it fixes given another value is refused in one line, a default one takes its
    value; a retired variant's name is refused with the settings that run it now."""
    from fedcond.federation.methods import get_method, run_config
    from fedcond.tools.experiment import expand_methods
    from fedcond.tools.flwr_commands import default_config

    config = run_config({**default_config(), "method": "recommended"})  # Flower's merged run config
    assert (config.method, config.fingerprint, config.conditioning) == ("recommended", "class-mean", "hyper")
    assert (config.condition_scale, config.hyper_init) == ("unit", "zero")
    assert (
        get_method("recommended").conditioned and get_method("recommended").client is get_method("conditional").client
    )
    from fedcond.variants import VARIANTS

    assert "recommended" not in expand_methods("all") and expand_methods("variants") == list(VARIANTS)
    assert main(["run", "method=recommended", "fingerprint=eigen"]) == 2
    assert "drop fingerprint=eigen, or use method=conditional" in capsys.readouterr().err
    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "fedavg,recommended", "--out", str(out), "--dry-run"]) == 0
    assert "method-recommended_seed-0" in capsys.readouterr().out
    assert main(["compare", "--methods", "fedavg,scaled-hyper-momentum", "--out", str(out), "--dry-run"]) == 2
    assert "run method=recommended server-momentum=0.5" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_prints_only_its_own_lines_and_keeps_flowers_and_rays_in_each_runs_log(tmp_path, capfd):
    import re

    out = tmp_path / "c"
    arguments = ["--methods", "fedavg", "--num-clusters", "2", "--clients-per-cluster", "2", "--rounds", "1"]
    assert main(["compare", *arguments, "--out", str(out)]) == 0
    printed, errors = capfd.readouterr()
    own = re.compile(r"^(fedcond: |  \[\d+/\d+\] |\||- |$)")  # progress, the summary table and its notes
    assert [line for line in (printed + errors).splitlines() if not own.match(line)] == []
    log = (out / "runs" / "method-fedavg_seed-0" / "flower.log").read_text()
    assert "run_simulation" in log  # Flower's own (deprecation) warning, here rather than on the terminal
    assert not list((out / "runs").glob(".*.flower.log"))  # moved into the run's folder


@pytest.mark.parametrize(
    "words",
    [
        ["compare", "--dataset", "digits", "data-fraction=0.5", "--methods", "conditional", "--out", "{out}",
         "fingerprint={fingerprint}", "--dry-run"],
        ["run", "data-fraction=0.5", "--dry-run", "fingerprint={fingerprint}", "method=conditional"],
    ],
    ids=["compare", "run"],
)  # fmt: skip
def test_settings_may_come_anywhere_among_the_options(tmp_path, capsys, words):
    """A setting after an option is read as a setting, not refused by argparse: a good value runs
    (the dry run), a bad one gets the setting's own one-line refusal."""
    fill = {"out": str(tmp_path / "o")}
    assert main([word.format(**fill, fingerprint="class-mean") for word in words]) == 0
    assert "conditional" in capsys.readouterr().out
    assert main([word.format(**fill, fingerprint="nonsense") for word in words]) == 2
    assert capsys.readouterr().err.startswith("fedcond: error: unknown fingerprint 'nonsense'; choose one of")


def test_submit_checks_every_setting_before_anything_is_submitted(capsys):
    """Flower would answer a misspelled key with `[code: 15] Invalid run configuration` alone."""
    assert main(["submit", "fl", "num-clusterz=3"]) == 2
    assert capsys.readouterr().err.startswith("fedcond: error: unknown run-config key 'num-clusterz'; known keys:")
