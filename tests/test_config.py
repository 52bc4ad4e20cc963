import dataclasses

import pytest

from fedcond.config import Option, RunConfig
from fedcond.data.scenarios import validate_without_data
from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.methods import declared_options, get_method, run_config
from fedcond.model.conditioning import MECHANISMS
from fedcond.tools.flwr_commands import default_config, parse_assignments
from tests.method_settings import method_test_settings


def test_pyproject_defaults_are_a_valid_config():
    config = run_config(default_config())
    assert config == RunConfig(options=config.options)
    assert run_config(config.to_mapping()) == config


def test_methods_declare_their_options_and_pyproject_lists_them():
    # Flower accepts only run-config keys the app declares: the run config (pyproject's block, generated
    # from it) holds every RunConfig field and every declared option, and no key is both.
    keys = {option.key for option in declared_options()}
    fields = {field.name.replace("_", "-") for field in dataclasses.fields(RunConfig) if field.name != "options"}
    assert set(default_config()) == keys | fields and not keys & fields
    assert keys <= set(default_config())
    config = run_config({"method": "ditto", "ditto-lambda": 2})
    assert dict(config.options)["ditto-lambda"] == 2.0 and config.to_mapping()["dac-neighbours"] == 3
    with pytest.raises(FedcondError, match="ditto-personal-epochs must be at least 1"):
        run_config({"ditto-personal-epochs": 0})
    with pytest.raises(FedcondError, match="unknown run-config key 'ditto-lambda'"):
        RunConfig.from_mapping({"ditto-lambda": 1.0})  # without the registry's declarations
    assert Option("x", 4, "an option").of(RunConfig()) == 4  # a config built without it: the default
    # The round protocol's settings belong to every federated method, none to the pooled ones.
    assert {"min-answered-fraction", "round-timeout"} <= {option.key for option in get_method("local").options}
    assert get_method("pooled-global").options == ()
    with pytest.raises(FedcondError, match=r"min-answered-fraction must be at most 1 \(got 1.5\)"):
        run_config({"min-answered-fraction": 1.5})
    with pytest.raises(FedcondError, match=r"round-timeout must be at least 0 \(got -1\)"):
        run_config({"round-timeout": -1})


def test_dataset_defaults_are_resolved():
    assert RunConfig().resolved().local_epochs == 5 and RunConfig().resolved().batch_size == 16
    mnist = RunConfig(dataset="mnist").resolved()
    assert (mnist.local_epochs, mnist.batch_size) == (1, 64)
    assert RunConfig(dataset="mnist", local_epochs=3).resolved().local_epochs == 3


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"num-clustres": 3}, "unknown run-config key 'num-clustres'"),
        ({"num-clusters": "three"}, "needs a int"),
        ({"num-clusters": 0}, "num-clusters must be at least 1"),
        ({"learning-rate": -1.0}, "learning-rate must be positive"),
        ({"normalisation": "zscore"}, "unknown normalisation"),
        ({"verbose": "maybe"}, "needs a bool"),
        ({"fingerprint": "pca"}, "unknown fingerprint 'pca'; choose one of eigen, eigen-x, class-mean"),
        ({"conditioning": "telepathy"}, "unknown conditioning 'telepathy'; choose one of " + ", ".join(MECHANISMS)),
        ({"held-out-clients": -1}, "held-out-clients must be 0 or more"),
        ({"fingerprint": "class-mean", "normalisation": "log"}, "use normalisation=federated or none"),
        # Issue 14: values that used to start a run (or end in a traceback inside it).
        ({"seed": -1}, r"seed must be an integer in 0\.\.4294967295 \(got -1\)"),
        ({"seed": 2**32}, "seed must be an integer in 0"),
        ({"learning-rate": float("inf")}, r"learning-rate must be positive and finite \(got inf\)"),
        ({"learning-rate": float("nan")}, "learning-rate must be positive and finite"),
        ({"learning-rate": 0}, "learning-rate must be positive and finite"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ({"momentum": -0.1}, r"momentum must be in \[0, 1\)"),
        ({"momentum": float("nan")}, r"momentum must be in \[0, 1\)"),
        ({"fingerprint-dim": 100000}, r"fingerprint-dim must be at most 1024 \(got 100000\)"),
        ({"fingerprint-dim": 0}, "fingerprint-dim must be at least 1"),
        ({"run-name": "../../x"}, "run-name '../../x' must be a plain folder name .*where runs go with results-dir"),
        ({"run-name": "a/b"}, "run-name 'a/b' must be a plain folder name"),
        ({"run-name": "a\\b"}, "must be a plain folder name"),
        ({"run-name": ".."}, "must be a plain folder name"),
        ({"run-name": "/tmp/x"}, "must be a plain folder name"),
    ],
)
def test_bad_settings_give_one_line_errors(mapping, message):
    with pytest.raises(FedcondError, match=message) as error:
        RunConfig.from_mapping(mapping)
    assert "\n" not in str(error.value)


def test_limits_leave_the_values_at_their_edges_alone():
    # The bounds refuse only what is out of range: the edges themselves still make a config.
    config = RunConfig.from_mapping({"seed": 2**32 - 1, "fingerprint-dim": 1024, "momentum": 0.0, "run-name": "a.b-1"})
    assert (config.seed, config.fingerprint_dim, config.run_name) == (2**32 - 1, 1024, "a.b-1")


def test_method_options_refuse_non_finite_numbers():
    for value in (float("inf"), float("nan")):
        with pytest.raises(FedcondError, match="ditto-lambda must be a finite number"):
            run_config({"ditto-lambda": value})


def test_unknown_method_dataset_and_scenario():
    with pytest.raises(FedcondError, match=r"unknown method 'no-such-method'; choose one of .*fedavg"):
        get_method("no-such-method")
    with pytest.raises(FedcondError, match="unknown dataset 'cifar7'"):
        validate_without_data(RunConfig(dataset="cifar7"))
    with pytest.raises(FedcondError, match="unknown scenario 'drift'"):
        validate_without_data(RunConfig(scenario="drift"))


def test_cli_assignments_parse_toml_literals():
    assert parse_assignments(["num-clusters=5", "method=fedavg", 'data-dir="/x y"', "learning-rate=0.1"]) == {
        "num-clusters": 5, "method": "fedavg", "data-dir": "/x y", "learning-rate": 0.1,
    }  # fmt: skip
    with pytest.raises(FedcondError, match="not key=value"):
        parse_assignments(["fedavg"])


def test_held_out_clients_count_as_nodes_and_are_refused_where_meaningless(monkeypatch, tmp_path):
    from fedcond.strategies.local import LocalStrategy

    from fedcond.federation.methods import flower_method_names

    config = RunConfig(num_clusters=2, clients_per_cluster=3, held_out_clients=1)
    assert (config.num_clients, config.num_training_clients) == (8, 6)
    for method in flower_method_names():  # every method has a rule for a newcomer (fedcond.newcomers)
        declared = run_config({**method_test_settings(method, tmp_path), "method": method})
        check_run(config.replace(method=method, dataset=declared.dataset, data_dir=declared.data_dir))
    # A method without one (a future method's strategy that says so) is refused in one line.
    monkeypatch.setattr(LocalStrategy, "serves_held_out_clients", False)
    with pytest.raises(FedcondError, match="held-out-clients has no meaning for local") as error:
        check_run(config.replace(method="local"))
    suggested = str(error.value).split("--methods ")[1].rstrip(")").split(",")
    assert {"fedavg", "conditional"} <= set(suggested) and "local" not in suggested
    check_run(RunConfig(method="local"))  # no held-out clients: nothing to refuse


def test_the_pyproject_block_and_the_settings_page_are_generated_from_the_declarations():
    """Every setting is declared once (a RunConfig field or an Option); Flower's block in pyproject.toml
    and docs/settings.md are what ``python -m tools.docs`` makes of those declarations."""
    from pathlib import Path

    from fedcond.tools.settings import settings
    from tools.docs import pyproject_block, replace_block, settings_markdown
    from tools.method_docs import regenerated

    root = Path(__file__).resolve().parents[1]
    pyproject = (root / "pyproject.toml").read_text()
    assert replace_block(pyproject) == pyproject, "run python -m tools.docs"
    assert (root / "docs" / "settings.md").read_text() == settings_markdown(), "run python -m tools.docs"
    for path, text in regenerated(root).items():  # the method tables, from the methods' Facts
        assert path.read_text() == text, f"{path.name}: run python -m tools.docs"
    keys = [row.key for row in settings()]
    assert len(keys) == len(set(keys)) and set(keys) == set(default_config())
    assert set(keys) == set(RunConfig().to_mapping()) - {"options"} | {o.key for o in declared_options()}
    assert all(row.help and "|" not in row.help for row in settings())  # a table cell each
    assert "node-timeout = 60" in pyproject_block().split("# The round protocol")[1]  # beside round-timeout


def test_channels_last_is_cifars_default_and_takes_the_words_and_toml_booleans():
    assert run_config({"dataset": "cifar10"}).channels_last == "auto"
    assert run_config({"dataset": "cifar10"}).resolved().channels_last == "true"
    assert run_config({"dataset": "cifar100"}).uses_channels_last
    assert run_config({"dataset": "mnist"}).resolved().channels_last == "false"
    assert not run_config({"dataset": "digits"}).uses_channels_last
    assert run_config({"dataset": "cifar10", "channels-last": False}).resolved().channels_last == "false"
    assert run_config({"dataset": "mnist", "channels-last": "True"}).uses_channels_last
    with pytest.raises(FedcondError, match="channels-last must be auto, true or false"):
        run_config({"channels-last": "maybe"})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"newcomer-steps": 5}, r"this run has none; set held-out-clients=1 \(or more\), or newcomer-steps=0"),
        ({"method": "pooled-conditional", "held-out-clients": 1, "newcomer-steps": 5},
         "pooled-conditional trains centrally on pooled data: set newcomer-steps=0"),
        ({"newcomer-steps": -1}, "newcomer-steps must be at least 0"),
    ],
)  # fmt: skip
def test_newcomer_steps_without_newcomers_or_federation_are_refused_in_one_line(settings, message):
    with pytest.raises(FedcondError, match=message):
        check_run(run_config(settings))


def test_the_settings_with_a_table_offer_exactly_its_values():
    """The help of dataset, scenario, fingerprint and conditioning lists its table's keys (it once
    offered conditioning=mlp, which the table lacks, and left eigenvector out)."""
    from dataclasses import fields

    from fedcond.tools.settings import setting_choices, settings

    helps = {row.key: row.help for row in settings()}
    tabled = {field.name: setting_choices(field) for field in fields(RunConfig) if setting_choices(field)}
    assert set(tabled) == {"dataset", "scenario", "fingerprint", "conditioning"}
    for name, choices in tabled.items():
        key = name.replace("_", "-")
        assert helps[key].endswith("; one of " + ", ".join(f"`{choice}`" for choice in choices))
    assert "eigenvector" in tabled["fingerprint"] and "`mlp`" not in helps["conditioning"]


def test_a_clientapp_reads_a_runs_settings_once_into_one_typed_resolved_object():
    """Every message of a run brings the same raw settings; the ClientApp's mods and clients get one
    typed object, made once per run and process, its dataset defaults filled in."""
    from fedcond.federation.client_app import client_run_config

    raw = {**default_config(), "method": "ditto", "dataset": "digits"}
    first, again = client_run_config(raw), client_run_config(dict(reversed(list(raw.items()))))
    assert first is again  # the same settings in any order: read once
    assert first.local_epochs > 0 and first.batch_size > 0  # "dataset default" (0) resolved
    assert first == first.resolved()
    other = client_run_config({**raw, "seed": 7})
    assert other is not first and other.seed == 7
