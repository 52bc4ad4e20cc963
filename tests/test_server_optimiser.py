"""``server-momentum`` and ``server-learning-rate``: FedAvgM on the server of the FedAvg family
(``fedcond/server_optimiser.py``, ``strategies/fedavg.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvgM

from fedcond.aggregation import weighted_average
from fedcond.errors import FedcondError
from fedcond.models import build_model, trained_arrays
from fedcond.scenarios import scenario_for
from fedcond.server_optimiser import SERVER_MOMENTUM, ServerMomentum
from fedcond.tools.experiment import read_history
from fedcond.tools.in_process import run_in_process
from strategies.base import StrategyInputs
from strategies.checks import check_run
from strategies.registry import get_method, run_config

BUFFERS = {"running_mean", "running_var", "num_batches_tracked"}
SMALL = {"num-clusters": 2, "clients-per-cluster": 2, "verbose": False}


def fit_res(model, samples: int) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(model), samples, {})


def test_the_server_step_is_flowers_fedavgm_on_trained_weights():
    rng = np.random.default_rng(0)
    initial = [rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(4).astype(np.float32)]
    flower = FedAvgM(initial_parameters=ndarrays_to_parameters(initial), server_momentum=0.9, server_learning_rate=0.7)
    ours = ServerMomentum(0.9, 0.7, [True, True])
    current = initial
    for server_round in (1, 2, 3):
        models = [[layer + rng.standard_normal(layer.shape).astype(np.float32) for layer in current] for _ in range(3)]
        counts = [5, 10, 20]
        replies = [(None, fit_res(model, count)) for model, count in zip(models, counts, strict=True)]
        expected, _ = flower.aggregate_fit(server_round, replies, [])
        current = ours.step(current, weighted_average(models, counts))
        for mine, theirs in zip(current, parameters_to_ndarrays(expected), strict=True):
            assert mine.dtype == theirs.dtype
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)


def test_batch_norm_buffers_are_the_round_average_as_it_is():
    # A running variance that falls from 1.0 to 0.1 in one round: a momentum step on it would go on past
    # the average (to a negative variance after a few rounds); the buffer is the average, every round.
    step = ServerMomentum(0.9, 1.0, [True, False])
    current = [np.ones(2, np.float32), np.ones(2, np.float32)]
    for _ in range(3):
        average = [current[0] - 0.5, np.full(2, 0.1, np.float32)]
        current = step.step(current, average)
        np.testing.assert_array_equal(current[1], average[1])
    # The weight's velocity builds up: 0.5, then 0.5 + 0.45, then 0.5 + 0.45 + 0.405 below the start.
    np.testing.assert_allclose(current[0], 1.0 - (0.5 + 0.95 + 1.355), rtol=1e-6)


def test_the_arrays_stepped_are_the_trained_weights_not_batch_norms_statistics():
    model = build_model((3, 32, 32), 10, 0, 0)  # the CIFAR network, with batch norm
    stepped = dict(zip(model.state_dict(), trained_arrays(model), strict=True))
    buffers = {name for name, is_trained in stepped.items() if not is_trained}
    assert buffers and all(name.rsplit(".", 1)[1] in BUFFERS for name in buffers)
    assert {name.rsplit(".", 1)[1] for name in buffers} == BUFFERS


def strategy_of(**settings):
    config = run_config({"method": "fedavg", **SMALL, **settings})
    check_run(config)
    method = get_method("fedavg")
    strategy = method.strategy(StrategyInputs(config, 10, method.conditioned, None, scenario=scenario_for(config)))
    return strategy


def test_plain_settings_are_fedavg_and_momentum_steps_from_the_model_the_clients_received():
    plain, moving = strategy_of(), strategy_of(**{"server-momentum": 0.5})
    assert plain.server_momentum is None  # the average is the new model, untouched
    start = parameters_to_ndarrays(moving.initial_global())
    trained = moving.server_momentum.trained
    shifted = [array + 1 if stepped else array for array, stepped in zip(start, trained, strict=True)]
    results = [(0, fit_res(shifted, 10)), (1, fit_res(shifted, 30))]
    np.testing.assert_array_equal(parameters_to_ndarrays(plain.combine(1, results))[0], shifted[0])
    first = parameters_to_ndarrays(moving.combine(1, results))
    np.testing.assert_allclose(first[0], start[0] + 1, rtol=1e-6)  # round 1: the update itself
    again = [array + 1 if stepped else array for array, stepped in zip(first, trained, strict=True)]
    second = parameters_to_ndarrays(moving.combine(2, [(0, fit_res(again, 10))]))
    # Round 2 steps from round 1's model by its own update (+1) plus half of round 1's (+0.5).
    np.testing.assert_allclose(second[0], start[0] + 2.5, rtol=1e-5)
    # The same step from SecAgg+'s mean, which is all the server sees there.
    secure = strategy_of(**{"server-momentum": 0.5})
    np.testing.assert_allclose(parameters_to_ndarrays(secure.combine_sum(1, shifted))[0], first[0])


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"method": "gossip", "server-momentum": 0.9}, "server-momentum=0.9: gossip has no server average to step"),
        ({"server-learning-rate": 0}, "server-learning-rate must be positive"),
        ({"server-momentum": 1.0}, "server-momentum must be at most 0.99"),
        ({"server-momentum": 0.9, "client-dp": "server-side"}, "set server-momentum=0"),
    ],
)
def test_server_optimiser_settings_are_refused_in_one_line_before_anything_starts(settings, refusal):
    with pytest.raises(FedcondError, match=refusal):
        check_run(run_config({"method": "fedavg", **SMALL, **settings}))


def test_a_run_with_server_momentum_trains_and_records_a_different_history(tmp_path):
    rows = {}
    for label, momentum in (("plain", 0.0), ("fedavgm", 0.5)):
        config = run_config({"method": "fedavg", **SMALL, "num-server-rounds": 3, "server-momentum": momentum,
                             "results-dir": str(tmp_path), "run-name": label})  # fmt: skip
        recorder, _ = run_in_process(config)
        rows[label] = read_history(recorder.folder / "history.csv")
    assert [row["round"] for row in rows["fedavgm"]] == ["1", "2", "3"]
    assert rows["fedavgm"][0]["accuracy"] == rows["plain"][0]["accuracy"]  # round 1's step is the average's
    assert rows["fedavgm"][-1]["accuracy"] != rows["plain"][-1]["accuracy"]
    assert float(rows["fedavgm"][-1]["accuracy"]) > 0.5


def test_a_variant_may_fix_a_method_option_and_a_clientapp_reads_it_from_flowers_merged_config():
    from clients.app import client_run_config
    from fedcond.tools.flwr_commands import default_config
    from fedcond.variants import VARIANTS

    name, *_ = [name for name, variant in VARIANTS.items() if dict(variant.settings).get("server-momentum")]
    fixed = dict(VARIANTS[name].settings)["server-momentum"]
    assert SERVER_MOMENTUM.of(run_config({"method": name})) == fixed
    with pytest.raises(FedcondError, match=f"method={name} is conditional with server-momentum={fixed}"):
        run_config({"method": name, "server-momentum": 0.9}, {"server-momentum": 0.9})
    # Flower's run config holds every key at its default; the server's method table takes the variant's.
    assert SERVER_MOMENTUM.of(run_config({**default_config(), "method": name})) == fixed
    assert dict(client_run_config({**default_config(), "method": name}).options)["server-momentum"] == fixed
