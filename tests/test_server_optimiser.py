"""``server-momentum`` and ``server-learning-rate``: FedAvgM on the server of every method whose server
averages a model (``fedcond/model/server_optimiser.py``): the global model of the FedAvg family
(``strategies/fedavg.py``), each cluster model of Oracle, IFCA, CFL and descriptor clustering
(``fedcond/federation/cluster_models.py``); refused by the methods whose server averages none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvgM

from fedcond.data.scenarios import scenario_for
from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.messages import CHOICE, PAYLOAD_PARTS, TRAIN_LOSS, pack_parts
from fedcond.federation.methods import get_method, run_config
from fedcond.federation.server_method import StrategyInputs
from fedcond.federation.strategy import FedcondStrategy
from fedcond.model.aggregation import weighted_average
from fedcond.model.networks import build_model, build_run_model, trained_arrays
from fedcond.model.server_optimiser import SERVER_LEARNING_RATE, SERVER_MOMENTUM, ServerMomentum
from fedcond.tools.experiment import read_history
from fedcond.tools.in_process import run_in_process

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
    inputs = StrategyInputs(config, 10, method.conditioned, None, scenario=scenario_for(config))
    strategy = FedcondStrategy(method.strategy(inputs)).method
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


def test_a_variant_may_fix_a_method_option_and_a_clientapp_reads_it_from_flowers_merged_config(monkeypatch):
    from fedcond.federation.client_app import client_run_config
    from fedcond.tools.flwr_commands import default_config
    from fedcond.variants import VARIANTS, Variant

    # No variant fixes a method's own option today (recommended's settings are RunConfig fields, and the
    # server optimiser is every averaging arm's, not a method's): one that did must still work.
    name, fixed = "conditional-fedavgm", 0.5
    monkeypatch.setitem(VARIANTS, name, Variant("conditional", "a test variant", (("server-momentum", fixed),)))
    assert SERVER_MOMENTUM.of(run_config({"method": name})) == fixed
    with pytest.raises(FedcondError, match=f"method={name} is conditional with server-momentum={fixed}"):
        run_config({"method": name, "server-momentum": 0.9}, {"server-momentum": 0.9})
    # Flower's run config holds every key at its default; the server's method table takes the variant's.
    assert SERVER_MOMENTUM.of(run_config({**default_config(), "method": name})) == fixed
    assert dict(client_run_config({**default_config(), "method": name}).options)["server-momentum"] == fixed


# -- one server optimiser for every method whose server averages a model ------------------------------
#: FedAvgM's settings in the tests below: a momentum and a step other than 1, so that both count.
MOMENTUM = {"server-momentum": 0.5, "server-learning-rate": 0.8}
AVERAGING = ["oracle", "ifca", "cfl", "descriptor-clustering", "fedavg", "conditional", "ditto", "fedprox", "fedbn",
             "scaffold"]  # fmt: skip
NOT_AVERAGING = {
    "local": "local has no server average to step (no model leaves a client",
    "gossip": "gossip has no server average to step (each client averages its model with one random peer's)",
    "dac": "dac has no server average to step (each client averages its model with its most similar peers'",
    "pfedhn": "pfedhn has no server average to step (its server trains a hypernetwork from the clients' updates with "
    "its own optimiser, pfedhn-lr)",
}


def method_strategy(method: str, folder: Path, **settings):
    """``method``'s strategy as the ServerApp builds it on digits E1 K=2 x 2 (partitions 0, 1 in true
    cluster 0; 2, 3 in cluster 1; FedBN on made-up CIFAR-10 images under ``folder``), after ``check_run``."""
    from tests.method_settings import method_test_settings

    chosen = get_method(method)
    config = run_config({"method": method, **SMALL, **method_test_settings(method, folder), **settings})
    check_run(config)
    inputs = StrategyInputs(config, 10, chosen.conditioned, None, scenario=scenario_for(config))
    return FedcondStrategy(chosen.strategy(inputs)).method


def near(model, trained, rng) -> list[np.ndarray]:
    """A client's trained model: ``model`` moved at random in its trained weights (buffers as they are)."""
    return [(array + rng.normal(size=array.shape)).astype(array.dtype) if stepped else array.copy()
            for array, stepped in zip(model, trained, strict=True)]  # fmt: skip


def cluster_replies(strategy, chosen: dict[int, int], rng) -> tuple[list, dict[int, list]]:
    """Each partition of ``chosen`` replies with its model (``chosen[pid]``, which IFCA's client also
    reports as its choice) moved at random, with samples of its own; and the replies' models by model."""
    trained = trained_arrays_of(strategy)
    replies, by_model = [], {}
    for pid, index in sorted(chosen.items()):
        model = near(strategy.models[index], trained, rng)
        by_model.setdefault(index, []).append((model, 10 + 7 * pid))
        res = fit_res(model, 10 + 7 * pid)
        res.metrics.update({TRAIN_LOSS: 0.0, CHOICE: index})
        replies.append((pid, res))
    return replies, by_model


def trained_arrays_of(strategy) -> list[bool]:
    inputs = strategy.inputs
    return trained_arrays(build_run_model(inputs.config, inputs.num_classes, inputs.conditioned))


def assert_models_equal(got, expected) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.dtype == theirs.dtype
        np.testing.assert_array_equal(mine, theirs)


def test_fedavgm_over_ifcas_models_is_one_independent_fedavgm_stream_per_model(tmp_path):
    """Each of IFCA's two models steps along the average of the clients that chose it, as Flower's own
    FedAvgM would on that model alone; in round 2 nobody chooses model 1: it keeps its parameters and
    its velocity, so round 3's step is its second (the velocity of round 1, not decayed)."""
    strategy = method_strategy("ifca", tmp_path, **MOMENTUM)
    rng = np.random.default_rng(0)
    flower = [FedAvgM(initial_parameters=ndarrays_to_parameters(model), server_momentum=0.5, server_learning_rate=0.8)
              for model in strategy.models]  # fmt: skip
    steps = [0, 0]  # each stream's own step count (Flower's FedAvgM starts its velocity at its round 1)
    choices = [{0: 0, 1: 0, 2: 1, 3: 1}, dict.fromkeys(range(4), 0), {0: 1, 1: 0, 2: 1, 3: 1}]
    for server_round, chosen in enumerate(choices, start=1):
        kept = [list(model) for model in strategy.models]
        velocities = [stream.state() for stream in strategy.server_momentum.streams]
        replies, by_model = cluster_replies(strategy, chosen, rng)
        assert strategy.combine(server_round, replies) is None
        for index in range(2):
            if index not in by_model:  # nobody chose it: kept, and its velocity untouched
                assert_models_equal(strategy.models[index], kept[index])
                assert_models_equal(strategy.server_momentum.streams[index].state(), velocities[index])
                continue
            steps[index] += 1
            theirs = [(None, fit_res(model, samples)) for model, samples in by_model[index]]
            expected, _ = flower[index].aggregate_fit(steps[index], theirs, [])
            for mine, flowers in zip(strategy.models[index], parameters_to_ndarrays(expected), strict=True):
                np.testing.assert_allclose(mine, flowers, rtol=1e-5, atol=1e-6)
    assert steps == [3, 2]


def test_fedavgm_under_oracle_is_one_stream_per_true_cluster(tmp_path):
    """Oracle's models, each stepped by a ``ServerMomentum`` of its own on its true cluster's average:
    the same arrays, bit for bit; cluster 1's clients all fail round 2, which leaves its model and
    velocity as they were."""
    strategy = method_strategy("oracle", tmp_path, **MOMENTUM)
    assert strategy.assignment == {0: 0, 1: 0, 2: 1, 3: 1}
    rng = np.random.default_rng(1)
    trained = trained_arrays_of(strategy)
    streams = [ServerMomentum(0.5, 0.8, trained) for _ in range(2)]
    expected = [list(model) for model in strategy.models]
    for server_round, answering in enumerate([range(4), (0, 1), (1, 2, 3)], start=1):
        replies, by_model = cluster_replies(strategy, {pid: strategy.assignment[pid] for pid in answering}, rng)
        strategy.combine(server_round, replies)
        for cluster, members in by_model.items():
            models, counts = zip(*members, strict=True)
            expected[cluster] = streams[cluster].step(expected[cluster], weighted_average(models, counts))
        for cluster in range(2):
            assert_models_equal(strategy.models[cluster], expected[cluster])
            assert_models_equal(strategy.server_momentum.streams[cluster].state(), streams[cluster].state())
    assert len(streams[1].state()) and not np.array_equal(strategy.models[0][0], strategy.models[1][0])


def test_a_cfl_split_gives_each_half_the_parents_model_and_velocity(tmp_path):
    from tests.test_cfl import EAGER, opposite_updates

    strategy = method_strategy("cfl", tmp_path, **MOMENTUM, **dict(EAGER["options"]))
    trained = trained_arrays_of(strategy)
    parent = ServerMomentum(0.5, 0.8, trained)
    start = list(strategy.models[0])
    first = opposite_updates(strategy, dict.fromkeys(range(4), 3.0))
    strategy.combine(1, first)  # round 1: the warm-up, one cluster
    model = parent.step(start, weighted_average([parameters_to_ndarrays(res.parameters) for _, res in first],
                                                [res.num_examples for _, res in first]))  # fmt: skip
    assert_models_equal(strategy.models[0], model)
    second = opposite_updates(strategy, dict.fromkeys(range(4), 3.0))
    strategy.combine(2, second)  # the split, then each half's own step
    assert len(strategy.models) == len(strategy.server_momentum.streams) == 2
    halves = [parent, parent.copy()]
    for cluster, stream in enumerate(halves):
        members = [res for pid, res in second if strategy.assignment[pid] == cluster]
        average = weighted_average([parameters_to_ndarrays(res.parameters) for res in members],
                                   [res.num_examples for res in members])  # fmt: skip
        assert_models_equal(strategy.models[cluster], stream.step(model, average))
        assert_models_equal(strategy.server_momentum.streams[cluster].state(), stream.state())


def test_descriptor_clustering_makes_a_stream_for_each_cluster_it_finds(tmp_path):
    strategy = method_strategy("descriptor-clustering", tmp_path, **MOMENTUM)
    assert strategy.server_momentum.streams == []  # no cluster before the descriptors come
    strategy.place([np.array([0.0, 0.0]), np.array([0.1, 0.0]), np.array([5.0, 1.0]), np.array([5.1, 1.0])])
    assert len(strategy.models) == len(strategy.server_momentum.streams) == 2
    streams = [ServerMomentum(0.5, 0.8, trained_arrays_of(strategy)) for _ in range(2)]
    expected = [list(model) for model in strategy.models]
    replies, by_model = cluster_replies(strategy, dict(strategy.assignment), np.random.default_rng(2))
    strategy.combine(1, replies)
    for cluster, members in by_model.items():
        models, counts = zip(*members, strict=True)
        expected[cluster] = streams[cluster].step(expected[cluster], weighted_average(models, counts))
        assert_models_equal(strategy.models[cluster], expected[cluster])


@pytest.mark.parametrize("method", ["fedavg", "conditional", "ditto", "fedprox", "fedbn", "scaffold"])
def test_every_global_model_method_takes_the_server_step_on_its_average(method, tmp_path):
    """The FedAvg family's own combines (SCAFFOLD's included) end in FedAvgM's step from the model the
    clients received, with ``server-learning-rate`` (SCAFFOLD's global step size) and momentum."""
    strategy = method_strategy(method, tmp_path, **MOMENTUM)
    trained = trained_arrays_of(strategy)
    reference = ServerMomentum(0.5, 0.8, trained)
    current = parameters_to_ndarrays(strategy.initial_global())
    rng = np.random.default_rng(3)
    for server_round in (1, 2):
        models = [near(current, trained, rng) for _ in range(4)]
        replies = []
        for pid, model in enumerate(models):
            res = fit_res(model, 10 + pid)
            if strategy.reply_parts:  # SCAFFOLD's: the model and the change of the client's control variate
                arrays, names = pack_parts({"model": model, "control-change": [np.zeros_like(a) for a in model]})
                res = fit_res(arrays, 10 + pid)
                res.metrics[PAYLOAD_PARTS] = names
            replies.append((pid, res))
        got = parameters_to_ndarrays(strategy.combine(server_round, replies))
        current = reference.step(current, weighted_average(models, [10 + pid for pid in range(4)]))
        assert_models_equal(got, current)


@pytest.mark.parametrize("method", AVERAGING)
def test_plain_settings_make_no_optimiser_and_keep_no_velocity(method, tmp_path):
    """``server-momentum=0, server-learning-rate=1``: no optimiser object at all, so every method's
    numbers are those it had before the server optimiser existed, and its checkpoint holds no velocity."""
    strategy = method_strategy(method, tmp_path)
    if method == "descriptor-clustering":
        strategy.place([np.array([0.0, 0.0]), np.array([0.1, 0.0]), np.array([5.0, 1.0]), np.array([5.1, 1.0])])
    assert strategy.server_momentum is None
    assert not any(name.startswith("server-velocity") for name in strategy.state()[0])


def test_every_federated_method_either_averages_a_model_or_says_why_not():
    """The two lists above are the method table's, split by each strategy's ``server_step_refusal``:
    a new method lands in one of them (and in the tests over it) by what its strategy declares."""
    from fedcond.federation.methods import method_names

    refusals = {name: get_method(name).strategy.server_step_refusal
                for name in [*method_names("all"), *method_names("competitors")]}  # fmt: skip
    assert sorted(name for name, refusal in refusals.items() if refusal is None) == sorted(AVERAGING)
    assert sorted(name for name, refusal in refusals.items() if refusal) == sorted(NOT_AVERAGING)


@pytest.mark.parametrize("method", AVERAGING)
def test_check_run_passes_the_server_optimiser_for_every_method_whose_server_averages_a_model(method, tmp_path, capsys):
    from fedcond.tools.cli import main

    assert method_strategy(method, tmp_path, **MOMENTUM).server_momentum is not None  # check_run passed it
    if method in ("oracle", "ifca"):  # the user's command: a dry run, every setting checked
        assert main(["run", "--dry-run", f"method={method}", "server-momentum=0.5"]) == 0
        assert "fedcond: dry run: " in capsys.readouterr().out


@pytest.mark.parametrize("method", sorted(NOT_AVERAGING))
def test_a_method_whose_server_averages_no_model_refuses_the_server_optimiser_in_one_line(method, capsys):
    from fedcond.tools.cli import main

    for settings in ({"server-momentum": 0.5}, {"server-learning-rate": 0.5}):
        with pytest.raises(FedcondError) as refusal:
            check_run(run_config({"method": method, **SMALL, **settings}))
        ((key, value),) = settings.items()
        assert str(refusal.value).startswith(f"{key}={value:g}: {NOT_AVERAGING[method]}")
        assert str(refusal.value).endswith("; leave server-momentum=0 and server-learning-rate=1")
    check_run(run_config({"method": method, **SMALL}))  # the defaults: nothing to refuse
    assert main(["run", "--dry-run", f"method={method}", "server-momentum=0.5"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("fedcond: error: server-momentum=0.5: ") and NOT_AVERAGING[method] in line


def test_a_comparisons_server_optimiser_is_every_averaging_arms_and_no_arm_without_an_average():
    """Given to the whole comparison (compare's settings, a grid's [settings]), FedAvgM goes to each arm
    whose server averages a model and to none that has no average (it has no such tool); given to such
    an arm by name (a bundle) it is still refused."""
    from fedcond.tools.experiment import Experiment, plan
    from fedcond.tools.flwr_commands import default_config

    methods = ["fedavg", "ifca", *sorted(NOT_AVERAGING), "pooled-global"]
    experiment = Experiment({**SMALL, **MOMENTUM}, {"method": methods, "seed": [0]})
    planned = {run.config.method: run.config for run in plan(experiment, default_config(), Path("/nonexistent"))}
    assert set(planned) == set(methods)
    for method, config in planned.items():
        expected = (0.5, 0.8) if get_method(method).server_step_refusal is None else (0.0, 1.0)
        assert (SERVER_MOMENTUM.of(config), SERVER_LEARNING_RATE.of(config)) == expected, method
    bundle = {"label": "local-m", "method": "local", "server-momentum": 0.5}
    with pytest.raises(FedcondError, match="local has no server average to step"):
        plan(Experiment(dict(SMALL), {"method": [bundle], "seed": [0]}), default_config(), Path("/nonexistent"))


def test_oracle_with_momentum_resumed_after_round_2_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """FedAvgM's velocities (one per cluster model) are in the checkpoint: Oracle stopped before round 3
    and resumed computes round 3 as the run that never stopped, to the last bit of every model."""
    from fedcond.strategies.oracle import OracleStrategy

    from fedcond.records.checkpoint import RESUME, load_checkpoint
    from tests.test_resume import assert_same_models, history

    def config(name: str):
        return run_config({"method": "oracle", **SMALL, **MOMENTUM, "num-server-rounds": 3, "local-epochs": 1,
                           "data-fraction": 0.5, "results-dir": str(tmp_path), "run-name": name})  # fmt: skip

    run_in_process(config("straight"))
    start_round = OracleStrategy.start_round

    def stopped_before_round_3(self, server_round):
        if server_round == 3:
            raise RuntimeError("the machine went away")
        return start_round(self, server_round)

    monkeypatch.setattr(OracleStrategy, "start_round", stopped_before_round_3)
    with pytest.raises(RuntimeError, match="went away"):
        run_in_process(config("stopped"))
    monkeypatch.undo()
    folder = tmp_path / "stopped"
    assert load_checkpoint(folder).round == 2
    run_in_process(RESUME.set(config("stopped"), str(folder)))
    straight = load_checkpoint(tmp_path / "straight")
    assert history(folder) == history(tmp_path / "straight")
    assert_same_models(load_checkpoint(folder), straight)
    assert all(len(straight.models[f"server-velocity-{cluster}"]) for cluster in range(2))
