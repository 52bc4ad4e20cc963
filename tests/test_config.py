import pytest

from fedcond.cli import default_config, parse_assignments
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.methods import get_method
from fedcond.scenarios import validate_without_data


def test_pyproject_defaults_are_a_valid_config():
    config = RunConfig.from_mapping(default_config())
    assert config == RunConfig()
    assert RunConfig.from_mapping(config.to_mapping()) == config


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
    ],
)
def test_bad_settings_give_one_line_errors(mapping, message):
    with pytest.raises(FedcondError, match=message) as error:
        RunConfig.from_mapping(mapping)
    assert "\n" not in str(error.value)


def test_unknown_method_dataset_and_scenario():
    with pytest.raises(FedcondError, match="unknown method 'fedprox'; choose one of fedavg, conditional"):
        get_method("fedprox")
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
