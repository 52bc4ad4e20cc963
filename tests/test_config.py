import pytest

from fedcond.tools.cli import default_config, parse_assignments
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
        ({"fingerprint": "pca"}, "unknown fingerprint 'pca'; choose one of eigen, class-mean"),
        ({"conditioning": "gate"}, "unknown conditioning 'gate'; choose one of concat, film, hyper"),
        ({"held-out-clients": -1}, "held-out-clients must be 0 or more"),
        ({"fingerprint": "class-mean", "normalisation": "log"}, "use normalisation=federated or none"),
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


def test_held_out_clients_count_as_nodes_and_are_refused_where_meaningless():
    from fedcond.methods import check_held_out

    config = RunConfig(num_clusters=2, clients_per_cluster=3, held_out_clients=1)
    assert (config.num_clients, config.num_training_clients) == (8, 6)
    check_held_out(get_method("conditional"), config)  # global model + own fingerprint: fine
    for method in ("local", "ifca", "gossip", "dac"):
        with pytest.raises(FedcondError, match=f"held-out-clients has no meaning for {method}"):
            check_held_out(get_method(method), config)
    check_held_out(get_method("local"), RunConfig())  # no held-out clients: nothing to refuse
