"""One message per client per round (evaluate-in-fit): each training instruction also evaluates the
model it brings, and the history is the one the two-message protocol writes, for every method."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fedcond.config import RunConfig
from fedcond.federation.methods import flower_method_names, get_method, run_config
from fedcond.tools.in_process import run_in_process
from tests.method_settings import method_test_settings

# Every federated method of the registry and every named variant: a new method is compared too.
METHODS = flower_method_names()
ROUNDS = 3
# What the protocol itself changes: time, and the evaluate messages' downloads that no longer happen.
PROTOCOL_COLUMNS = {"seconds", "elapsed_seconds", "bytes_down"}


def config_for(method: str, folder: Path, evaluate_in_fit: bool, **settings: object) -> RunConfig:
    mapping: dict[str, object] = {
        "method": method, "num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": ROUNDS,
        "local-epochs": 1, "results-dir": str(folder), "verbose": False,
        "evaluate-in-fit": evaluate_in_fit, **method_test_settings(method, folder.parent), **settings,
    }  # fmt: skip
    if "ditto-personal-epochs" in {option.key for option in get_method(method).options}:
        mapping["ditto-personal-epochs"] = 1  # a method's own setting, only where it is read (check_run)
    if get_method(method).conditioned:
        mapping["normalisation"] = "none"  # the federated statistics need SecAgg+'s grid, which in_process lacks
    return run_config(mapping)


def history(folder: Path) -> list[dict[str, str]]:
    with (folder / "history.csv").open() as handle:
        return list(csv.DictReader(handle))


def compare_protocols(method: str, tmp_path: Path, **settings: object) -> tuple[dict, dict]:
    """The same run under both protocols: each history without the protocol's own columns, and the
    messages each sent."""
    outcomes = {}
    for evaluate_in_fit in (False, True):
        recorder, messages = run_in_process(config_for(method, tmp_path / str(evaluate_in_fit), evaluate_in_fit,
                                                       **settings))  # fmt: skip
        rows = [{k: v for k, v in row.items() if k not in PROTOCOL_COLUMNS} for row in history(recorder.folder)]
        outcomes[evaluate_in_fit] = (rows, dict(messages))
    return outcomes[False], outcomes[True]


@pytest.mark.parametrize("method", METHODS)
def test_one_message_per_round_writes_the_two_message_history_column_for_column(method, tmp_path):
    (two, two_messages), (one, one_messages) = compare_protocols(method, tmp_path)
    assert [row["round"] for row in one] == [str(r) for r in range(1, ROUNDS + 1)]
    assert one == two
    # 4 training clients: a fit each round, and one evaluate message each after the last round only.
    assert two_messages == {"fit": 4 * ROUNDS, "evaluate": 4 * ROUNDS}
    assert one_messages == {"fit": 4 * ROUNDS, "evaluate": 4}


def test_held_out_clients_keep_their_evaluate_message_and_their_column(tmp_path):
    """A newcomer never trains, so it has no fit to evaluate in: it is asked to evaluate every round."""
    (two, _), (one, one_messages) = compare_protocols("oracle", tmp_path, **{"held-out-clients": 1})
    assert one == two and all(row["heldout_accuracy"] != "nan" for row in one)
    assert one_messages == {"fit": 4 * ROUNDS, "evaluate": 4 + 2 * ROUNDS}


def test_the_setting_is_refused_in_one_line_when_it_is_not_a_boolean():
    from fedcond.errors import FedcondError

    with pytest.raises(FedcondError, match="evaluate-in-fit"):
        run_config({"evaluate-in-fit": "sometimes"})


def test_channels_last_reaches_every_clients_training_and_evaluation(tmp_path, monkeypatch):
    import fedcond.model.training as training

    layouts = []
    real = training.laid_out
    monkeypatch.setattr(training, "laid_out", lambda images, flag: layouts.append(flag) or real(images, flag))
    run_in_process(config_for("ditto", tmp_path, True, **{"channels-last": True, "num-server-rounds": 1}))
    assert layouts and all(layouts)  # Ditto: both models' training, and the evaluation


# -- client sampling (clients-per-round) -------------------------------------------------------------
def sampled_run(method: str, folder: Path, **settings: object):
    """2 of the 4 training clients a round, every client evaluating every second round and the last."""
    config = config_for(method, folder, True, **{"clients-per-round": 2, "evaluate-every": 2, **settings})
    return run_in_process(config)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_with_a_sample_of_clients_and_twice_gives_the_same_history(method, tmp_path):
    first, first_messages = sampled_run(method, tmp_path / "first")
    second, second_messages = sampled_run(method, tmp_path / "second")
    rows = [{k: v for k, v in row.items() if k not in PROTOCOL_COLUMNS} for row in history(first.folder)]
    assert rows == [{k: v for k, v in row.items() if k not in PROTOCOL_COLUMNS} for row in history(second.folder)]
    assert [row["round"] for row in rows] == ["1", "2", "3"]
    assert all(row["accuracy"] != "nan" and row["train_loss"] != "nan" for row in rows)
    # 2 fits a round; everyone evaluates after round 2 and 3 (evaluate-every=2, and the last round).
    assert first_messages == second_messages == {"fit": 2 * ROUNDS, "evaluate": 4 + 4}
    # Round 1's model was scored by round 2's sample (2 asked), round 2's by every client.
    assert [row["clients_asked"] for row in rows] == ["2", "4", "4"]


def test_the_sample_is_the_seed_and_the_round_alone_as_a_resumed_run_needs():
    from fedcond.federation.sampling import sample_partitions

    rounds = [sample_partitions(0, server_round, range(100), 10) for server_round in range(1, 6)]
    assert rounds == [sample_partitions(0, server_round, range(100), 10) for server_round in range(1, 6)]
    assert all(len(chosen) == 10 == len(set(chosen)) and chosen == sorted(chosen) for chosen in rounds)
    assert len({tuple(chosen) for chosen in rounds}) == 5  # a new sample every round
    assert sample_partitions(1, 1, range(100), 10) != rounds[0]  # and every seed
    assert sample_partitions(0, 1, range(100), 0) == list(range(100))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"clients-per-round": 5}, "clients-per-round=5 is more than the 4 training clients"),
        ({"clients-per-round": -1}, "clients-per-round must be at least 0"),
        ({"clients-per-round": 2, "evaluate-every": 0}, "evaluate-every must be at least 1"),
        ({"evaluate-every": 2}, "evaluate-every applies with clients-per-round"),
        ({"clients-per-round": 2, "secure-aggregation": "secaggplus", "secagg-min-clients": 3},
         "secagg-min-clients=3 clients, but clients-per-round=2 asks fewer"),
    ],
)  # fmt: skip
def test_bad_sampling_settings_are_refused_in_one_line_before_anything_starts(settings, message):
    from fedcond.errors import FedcondError
    from fedcond.federation.checks import check_run

    with pytest.raises(FedcondError, match=message.replace("(", r"\(")):
        check_run(run_config({"method": "fedavg", "num-clusters": 2, "clients-per-cluster": 2, **settings}))


def test_client_level_dp_adds_its_noise_over_the_sample_and_accounts_for_the_sampling_rate(tmp_path):
    from fedcond.federation.client_dp import describe

    dp = {"client-dp": "server-side", "client-dp-noise-multiplier": 0.1, "min-answered-fraction": 1.0}
    recorder, messages = sampled_run("fedavg", tmp_path, **dp)
    assert messages["fit"] == 2 * ROUNDS and all(row["accuracy"] != "nan" for row in history(recorder.folder))
    everyone = describe(config_for("fedavg", tmp_path, True, **dp))
    sampled = describe(config_for("fedavg", tmp_path, True, **{**dp, "clients-per-round": 2}))
    assert (sampled["clients_per_round"], sampled["client_sampling_rate"]) == (2, 0.5)
    assert everyone["client_sampling_rate"] == 1.0
    # Half the clients a round: twice the noise on their average, and a smaller epsilon for the same rounds.
    assert sampled["noise_std_on_the_average"] == pytest.approx(2 * everyone["noise_std_on_the_average"])
    assert all(s < e for s, e in zip(sampled["epsilon_by_round"], everyone["epsilon_by_round"], strict=True))


def test_a_sample_of_every_client_is_no_sample_and_keeps_one_message_a_round(tmp_path):
    _, messages = run_in_process(config_for("fedavg", tmp_path, True, **{"clients-per-round": 4}))
    assert messages == {"fit": 4 * ROUNDS, "evaluate": 4}
