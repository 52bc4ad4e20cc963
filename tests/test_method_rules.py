"""Each method does what its paper says: the server's rule through its strategy, the client's through its
client class, on hand-made models and real digits clients (no Flower). A method wired wrongly (Ditto
evaluating the global model, DAC averaging with its least similar peers, Oracle mixing clusters) fails here.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.common import Code, Context, FitRes, RecordDict, Status, ndarrays_to_parameters, parameters_to_ndarrays

from fedcond.config import RunConfig
from fedcond.data.client_data import load_client_data
from fedcond.data.scenarios import scenario_for
from fedcond.federation.declaration import NEWCOMER_RULES
from fedcond.federation.messages import CHOICE, SERVER_ROUND, TRAIN_LOSS
from fedcond.federation.methods import get_method, held_out_methods
from fedcond.federation.participation import EVALUATE, FIT
from fedcond.federation.server_method import StrategyInputs
from fedcond.federation.strategy import FedcondStrategy
from fedcond.model.networks import get_weights

SMALL = {"num_clusters": 2, "clients_per_cluster": 2, "local_epochs": 1}


def strategy_for(method: str, **settings):
    """The method's strategy as the ServerApp builds it, on digits E1 K=2 x 2 (partition ids 0, 1 in
    cluster 0; 2, 3 in cluster 1; held-out clients after them)."""
    config = RunConfig(method=method, **{**SMALL, **settings})
    chosen = get_method(method)
    inputs = StrategyInputs(config, 10, chosen.conditioned, None, scenario=scenario_for(config))
    return FedcondStrategy(chosen.strategy(inputs)).method


def reply(model, samples: int, **metrics) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(model), samples, {TRAIN_LOSS: 0.0, **metrics})


def constant_model(strategy, value: float) -> list[np.ndarray]:
    """A model of the run's shape whose every entry is ``value``."""
    from fedcond.federation.server_method import initial_weights

    return [np.full_like(array, value) for array in initial_weights(strategy.inputs)]


def decoded(parameters) -> list[np.ndarray]:
    return parameters_to_ndarrays(parameters)


def test_fedavg_weights_each_returned_model_by_its_training_samples():
    strategy = strategy_for("fedavg")
    results = [(0, reply(constant_model(strategy, 1.0), 100)), (1, reply(constant_model(strategy, 4.0), 300))]
    combined = decoded(strategy.combine(1, results))
    np.testing.assert_allclose(combined[0], 3.25, rtol=1e-6)  # (1 x 100 + 4 x 300) / 400, not the plain mean 2.5


def test_oracle_averages_within_each_true_cluster_and_serves_each_client_its_own():
    strategy = strategy_for("oracle", held_out_clients=1)
    values = {0: 1.0, 1: 3.0, 2: 10.0, 3: 30.0}  # partitions 0, 1: cluster 0; 2, 3: cluster 1
    strategy.combine(1, [(pid, reply(constant_model(strategy, value), 1)) for pid, value in values.items()])
    firsts = {pid: decoded(strategy.instruction(FIT, pid, None, {})[0])[0].flat[0] for pid in range(4)}
    assert firsts == pytest.approx({0: 2.0, 1: 2.0, 2: 20.0, 3: 20.0})
    # A newcomer (partition 4: cluster 0's held-out client, 5: cluster 1's) evaluates its true cluster's model.
    assert decoded(strategy.instruction(EVALUATE, 4, None, {})[0])[0].flat[0] == pytest.approx(2.0)
    assert decoded(strategy.instruction(EVALUATE, 5, None, {})[0])[0].flat[0] == pytest.approx(20.0)


def test_ifca_averages_by_choice_serves_the_chosen_model_and_scores_its_choices():
    strategy = strategy_for("ifca")
    choices = {0: 1, 1: 1, 2: 0, 3: 0}  # a perfect recovery of the true clusters, with the labels swapped
    values = {0: 1.0, 1: 3.0, 2: 10.0, 3: 30.0}
    results = [(pid, reply(constant_model(strategy, values[pid]), 1, **{CHOICE: choices[pid]})) for pid in values]
    strategy.combine(1, results)
    assert strategy.protocol.tracker.ari == pytest.approx(1.0)
    assert decoded(strategy.instruction(EVALUATE, 0, None, {})[0])[0].flat[0] == pytest.approx(2.0)  # model 1
    assert decoded(strategy.instruction(EVALUATE, 3, None, {})[0])[0].flat[0] == pytest.approx(20.0)  # model 0
    everything = decoded(strategy.instruction(FIT, 0, None, {})[0])
    assert len(everything) == 2 * len(constant_model(strategy, 0.0))  # training rounds send all K models
    mixed = strategy_for("ifca")
    mixed.combine(1, [(pid, reply(constant_model(mixed, 1.0), 1, **{CHOICE: pid % 2})) for pid in range(4)])
    assert mixed.protocol.tracker.ari < 0.5  # choices across the true clusters


def clustered_models(strategy, rng) -> dict[int, list[np.ndarray]]:
    """Models of cluster 0 (partitions 0, 1) near one direction, of cluster 1 (2, 3) near another."""
    directions = [rng.normal(size=array.shape) for array in constant_model(strategy, 0.0)]
    others = [rng.normal(size=array.shape) for array in directions]
    models = {}
    for pid in range(4):
        base = directions if pid < 2 else others
        models[pid] = [(b + 0.1 * rng.normal(size=b.shape)).astype(np.float32) for b in base]
    return models


def test_dac_averages_each_client_with_its_most_similar_peers_its_cluster_mates():
    strategy = strategy_for("dac", options=(("dac-neighbours", 1),))
    models = clustered_models(strategy, np.random.default_rng(0))
    strategy.combine(1, [(pid, reply(model, 1)) for pid, model in models.items()])
    for pid, mate in ((0, 1), (1, 0), (2, 3), (3, 2)):
        expected = [(a + b) / 2 for a, b in zip(models[pid], models[mate], strict=True)]
        received = decoded(strategy.instruction(FIT, pid, None, {})[0])
        for got, want in zip(received, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dac_compares_the_trained_weights_alone_not_batch_norms_buffers():
    """A buffer array (batch norm's step counter stands for it: each client's grows by its own step
    count) equal in clients 0 and 2 and far from it in 1 and 3 would make 0 and 2 the most similar
    pair; DAC compares the trained weights, whose nearest mates are 0-1 and 2-3."""
    strategy = strategy_for("dac", options=(("dac-neighbours", 1),))
    strategy.trained = [False, *strategy.trained[1:]]  # array 0 stands for a buffer here
    models = clustered_models(strategy, np.random.default_rng(0))
    for pid, steps in ((0, 100.0), (1, 900.0), (2, 100.0), (3, 900.0)):
        models[pid][0] = np.full_like(models[pid][0], steps)
    strategy.combine(1, [(pid, reply(model, 1)) for pid, model in models.items()])
    for pid, mate in ((0, 1), (1, 0), (2, 3), (3, 2)):
        received = decoded(strategy.instruction(FIT, pid, None, {})[0])
        np.testing.assert_allclose(received[1], (models[pid][1] + models[mate][1]) / 2, rtol=1e-5, atol=1e-6)


def test_gossip_averages_each_client_with_exactly_one_random_peer_per_round():
    strategy = strategy_for("gossip")
    models = clustered_models(strategy, np.random.default_rng(1))
    strategy.combine(1, [(pid, reply(model, 1)) for pid, model in models.items()])
    after = {pid: decoded(strategy.instruction(FIT, pid, None, {})[0]) for pid in range(4)}
    for pid in range(4):
        partners = [
            other for other in range(4)
            if other != pid and np.allclose(after[pid][0], (models[pid][0] + models[other][0]) / 2, atol=1e-6)
        ]  # fmt: skip
        assert len(partners) == 1  # a matching: one peer each (4 clients: nobody sits out)
        assert np.allclose(after[partners[0]][0], after[pid][0])  # the pair holds the same average


def test_local_keeps_nothing_on_the_server():
    strategy = strategy_for("local")
    assert strategy.combine(1, [(pid, reply([], 1)) for pid in range(4)]) is None
    assert strategy.initial_global().tensors == []


# Where each kind of newcomer rule (``fedcond.federation.methods.NEWCOMER_RULES``, which every method's
# declared Facts name) is tested on hand-made models: a new kind of rule needs its test here.
RULE_TESTS = {
    "global": "test_a_newcomer_gets_the_global_model_where_that_is_its_methods_rule",
    "global with its fingerprint": "test_a_conditioned_client_feeds_the_model_its_own_normalised_fingerprint",
    "true cluster": "test_oracle_averages_within_each_true_cluster_and_serves_each_client_its_own",
    "lowest-loss cluster": "test_an_ifca_newcomer_is_served_the_cluster_model_that_fits_its_training_data",
    "own untrained": "test_a_local_newcomer_has_only_its_own_untrained_model_until_its_steps_train_it",
    "random peer": "test_a_gossip_newcomer_is_served_one_random_training_clients_model_each_round",
    "lowest-loss peers": "test_a_dac_newcomer_averages_the_peer_models_with_the_lowest_loss_on_its_data",
    "nearest descriptor": "tests/test_descriptor_clustering.py::"
    "test_dbscan_finds_the_number_of_clusters_itself_and_places_a_newcomer_at_the_nearest_centroid",
    "split tree": "test_a_cfl_newcomer_trains_at_the_split_and_follows_the_side_its_update_agrees_with",
    "mean embedding": "tests/test_pfedhn.py::"
    "test_the_strategy_serves_participants_their_model_and_a_newcomer_the_mean_embeddings",
}


def newcomer_rule(method: str) -> str:
    facts = get_method(method).facts
    assert facts is not None, f"{method} declares no Facts in fedcond/federation/methods.py"
    return facts.newcomer_rule


def test_every_method_that_serves_newcomers_declares_a_rule_and_every_rule_has_its_test():
    assert {newcomer_rule(method) for method in held_out_methods()} <= set(NEWCOMER_RULES)
    assert set(RULE_TESTS) == set(NEWCOMER_RULES)
    root = Path(__file__).parent
    for test in RULE_TESTS.values():
        path, _, name = test.rpartition("::")
        source = (root.parent / path if path else Path(__file__)).read_text()
        assert f"def {name}(" in source, test


@pytest.mark.parametrize("method", [name for name in held_out_methods() if newcomer_rule(name).startswith("global")])
def test_a_newcomer_gets_the_global_model_where_that_is_its_methods_rule(method):
    """The client feeds its own fingerprint where the method is conditioned (tested below)."""
    strategy = strategy_for(method, held_out_clients=1)
    current = ndarrays_to_parameters(constant_model(strategy, 7.0))
    for partition in (4, 5):  # the held-out clients
        assert strategy.instruction(EVALUATE, partition, current, {})[0] is current
    assert 4 not in strategy.training_partitions  # and it is never asked to train


def client_of(method: str, partition_id: int = 0, **settings):
    config = RunConfig(method=method, **{**SMALL, **settings})
    chosen = get_method(method)
    context = Context(0, 0, {"partition-id": partition_id, "num-partitions": 4}, RecordDict(), {})
    return chosen.client(config, load_client_data(config, partition_id), context)


def always_class(client, label: int) -> list[np.ndarray]:
    """Weights that predict ``label`` for every image: zero everywhere but the last layer's bias."""
    weights = [np.zeros_like(array) for array in get_weights(client.model)]
    weights[-1][label] = 50.0
    return weights


def test_ditto_returns_the_global_model_and_is_evaluated_with_its_personal_one():
    ditto, fedavg = client_of("ditto", 2), client_of("fedavg", 2)
    start = get_weights(fedavg.fresh_model())
    round_config = {SERVER_ROUND: 1}
    returned, _, _ = ditto.fit(start, round_config)
    expected, _, _ = fedavg.fit(start, round_config)
    for got, want in zip(returned, expected, strict=True):  # the global model, trained as FedAvg trains it
        np.testing.assert_array_equal(got, want)
    # A global model that always says 0 scores chance at best on cluster 1 (classes 5-9): none.
    useless = always_class(ditto, 0)
    _, _, global_metrics = fedavg.evaluate(useless, round_config)
    _, _, ditto_metrics = ditto.evaluate(useless, round_config)
    assert global_metrics["accuracy"] == 0.0
    assert ditto_metrics["accuracy"] > 0.3  # its personal model, trained for ditto-personal-epochs


def test_fedprox_pulls_each_clients_training_towards_the_model_it_received():
    """Li et al. 2020, Algorithm 2 line 4: min F_k(w) + (mu / 2) ||w - w^t||^2. mu = 0 is FedAvg's
    client exactly; a larger mu ends nearer w^t, the model as received."""
    fedavg = client_of("fedavg", 2)
    start = get_weights(fedavg.fresh_model())
    start[-1] = start[-1] + 0.5  # w^t unlike the seeded initial model, so the anchor must be what arrived
    round_config = {SERVER_ROUND: 1}

    def distance_travelled(client) -> float:
        returned, _, _ = client.fit([array.copy() for array in start], round_config)
        return float(np.sqrt(sum(np.sum((got - sent) ** 2) for got, sent in zip(returned, start, strict=True))))

    without_pull = distance_travelled(fedavg)
    assert distance_travelled(client_of("fedprox", 2, options=(("fedprox-mu", 0.0),))) == without_pull
    pulled = distance_travelled(client_of("fedprox", 2, options=(("fedprox-mu", 10.0),)))
    assert pulled < 0.8 * without_pull, (pulled, without_pull)


@pytest.mark.parametrize("method", [m for m in held_out_methods() if newcomer_rule(m) == "global with its fingerprint"])
def test_a_conditioned_client_feeds_the_model_its_own_normalised_fingerprint(method, monkeypatch):
    import fedcond.federation.client as fedcond_client

    seen = []
    real_evaluate = fedcond_client.evaluate
    monkeypatch.setattr(fedcond_client, "evaluate", lambda *args: seen.append(args[3]) or real_evaluate(*args))
    round_config = {SERVER_ROUND: 1}
    clients = [client_of(method, pid, normalisation="log" if method == "conditional" else "none") for pid in (0, 2)]
    for client in clients:
        client.evaluate(get_weights(client.model), round_config)
    first, second = seen
    assert first is not None and second is not None and not np.allclose(first, second)  # each its own
    np.testing.assert_array_equal(first, clients[0].condition(round_config))
    assert client_of("fedavg").condition(round_config) is None  # FedAvg's model takes none


def test_the_ifca_client_trains_and_reports_the_model_that_fits_its_data_best():
    client = client_of("ifca", 2)  # cluster 1: classes 5-9
    wrong, right = always_class(client, 0), always_class(client, 7)
    _, _, metrics = client.fit([*wrong, *right], {SERVER_ROUND: 1})
    assert metrics[CHOICE] == 1
    _, _, metrics = client.fit([*right, *wrong], {SERVER_ROUND: 1})
    assert metrics[CHOICE] == 0


def newcomer_of(method: str, **settings):
    """Cluster 0's held-out client (partition 4 of digits E1 K=2 x 2 + 1): classes 0-4."""
    return client_of(method, 4, held_out_clients=1, **settings)


def test_an_ifca_newcomer_is_served_the_cluster_model_that_fits_its_training_data():
    newcomer = newcomer_of("ifca")
    wrong, right = always_class(newcomer, 9), always_class(newcomer, 0)
    accuracies = [newcomer.evaluate([*pair[0], *pair[1]], {SERVER_ROUND: 1})[2]["accuracy"]
                  for pair in ((wrong, right), (right, wrong))]  # fmt: skip
    assert accuracies[0] == accuracies[1] > 0  # whichever position, the model that says 0 (of classes 0-4)
    assert newcomer.evaluate([*wrong, *wrong], {SERVER_ROUND: 1})[2]["accuracy"] == 0.0


def test_a_cfl_newcomer_trains_at_the_split_and_follows_the_side_its_update_agrees_with():
    """One split of cluster 0 (its model says 9) into 0 (says 9) and 1 (says 0). The newcomer holds
    classes 0-4: training the split's model raises the output biases of 0-4, so it follows the side
    whose clients' updates did that, and is served that side's model, wherever that side is."""
    from fedcond.federation.messages import PARAMETER_TREE
    from fedcond.model.parameter_tree import Split, header, pack

    newcomer = newcomer_of("cfl")
    wrong, right = always_class(newcomer, 9), always_class(newcomer, 0)
    size = sum(array.size for array in wrong)
    low, high = np.zeros(size, np.float32), np.zeros(size, np.float32)
    low[size - 10 : size - 5], high[size - 5 :] = 1.0, 1.0  # the output biases of classes 0-4 and 5-9
    for directions, leaves in (((high, low), [wrong, right]), ((low, high), [right, wrong])):
        splits = [Split(0, 1, wrong, directions)]
        config = {SERVER_ROUND: 1, PARAMETER_TREE: header(2, splits)}
        assert newcomer.evaluate(pack(leaves, splits), config)[2]["accuracy"] > 0
    splits = [Split(0, 1, wrong, (high, low))]
    config = {SERVER_ROUND: 1, PARAMETER_TREE: header(2, splits)}
    assert newcomer.evaluate(pack([right, wrong], splits), config)[2]["accuracy"] == 0.0


def test_a_dac_newcomer_averages_the_peer_models_with_the_lowest_loss_on_its_data():
    strategy = strategy_for("dac", held_out_clients=1)
    models = {pid: constant_model(strategy, float(pid)) for pid in range(4)}
    strategy.models.update(1, models.items())  # each client's model after some round
    sent = decoded(strategy.instruction(EVALUATE, 4, None, {})[0])
    assert len(sent) == 4 * len(models[0])  # every training client's model, in partition order
    assert [sent[index * len(models[0])].flat[0] for index in range(4)] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    newcomer = newcomer_of("dac", options=(("dac-neighbours", 2),))
    wrong, right = always_class(newcomer, 9), always_class(newcomer, 0)
    right_too = always_class(newcomer, 0)
    right_too[-1][0] = 30.0  # says 0 less loudly: the average of the two that say 0 is between them
    served = newcomer.newcomer_model([*wrong, *right, *wrong, *right_too], {SERVER_ROUND: 1})
    np.testing.assert_allclose(get_weights(served)[-1][0], 40.0)
    assert get_weights(served)[-1][9] == 0.0  # neither model that says 9 took part


def test_a_gossip_newcomer_is_served_one_random_training_clients_model_each_round():
    strategy = strategy_for("gossip", held_out_clients=1)
    models = {pid: constant_model(strategy, float(pid)) for pid in range(4)}
    strategy.models.update(1, models.items())
    served = {}
    for server_round in range(1, 9):
        strategy.protocol.participation = type(strategy.protocol.participation)(server_round, ())
        served[server_round] = decoded(strategy.instruction(EVALUATE, 4, None, {})[0])[0].flat[0]
    assert set(served.values()) <= {0.0, 1.0, 2.0, 3.0} and len(set(served.values())) > 1  # drawn anew
    strategy.protocol.participation = type(strategy.protocol.participation)(3, ())
    assert decoded(strategy.instruction(EVALUATE, 4, None, {})[0])[0].flat[0] == served[3]  # seeded by (seed, round)


def test_a_local_newcomer_has_only_its_own_untrained_model_until_its_steps_train_it():
    newcomer = newcomer_of("local", options=(("newcomer-steps", 200),))
    untrained = get_weights(newcomer.fresh_model())
    assert all(np.array_equal(a, b) for a, b in zip(get_weights(newcomer.newcomer_model([], {})), untrained,
                                                     strict=True))  # fmt: skip
    _, _, metrics = newcomer.evaluate([], {SERVER_ROUND: 1})
    assert metrics["adapted-accuracy"] > metrics["accuracy"] + 0.3  # 200 steps on its own data teach it


def test_newcomer_steps_train_a_copy_for_exactly_that_many_steps_and_keep_the_served_model(monkeypatch):
    import fedcond.federation.client as fedcond_client

    batches = []
    real_train = fedcond_client.train
    monkeypatch.setattr(fedcond_client, "train", lambda model, x, *rest: batches.append(len(x)) or real_train(
        model, x, *rest))  # fmt: skip
    newcomer = newcomer_of("fedavg", options=(("newcomer-steps", 7),))
    served = get_weights(newcomer.fresh_model())
    _, _, metrics = newcomer.evaluate(served, {SERVER_ROUND: 1})
    assert batches == [7 * newcomer.train_settings.batch_size] and newcomer.train_settings.epochs >= 1
    assert all(np.array_equal(a, b) for a, b in zip(get_weights(newcomer.model), served, strict=True))
    assert 0 <= metrics["adapted-accuracy"] <= 1
    plain = newcomer_of("fedavg")
    assert "adapted-accuracy" not in plain.evaluate(served, {SERVER_ROUND: 1})[2]  # zero-shot only by default


def test_ifca_on_a_partition_without_clusters_records_no_ari():
    """A Dirichlet split has one population: an ARI against it would be 0 whatever IFCA chose."""
    strategy = strategy_for("ifca", scenario="dirichlet", num_clusters=1, clients_per_cluster=4,
                            options=(("ifca-models", 2),))  # fmt: skip
    model = constant_model(strategy, 0.0)
    strategy.groups(1, [(pid, reply(model, 10, **{CHOICE: pid % 2})) for pid in range(4)])
    assert math.isnan(strategy.protocol.tracker.ari)
    clustered = strategy_for("ifca")  # digits E1 K=2 x 2: choices that match the true clusters
    clustered.groups(1, [(pid, reply(model, 10, **{CHOICE: pid // 2})) for pid in range(4)])
    assert clustered.protocol.tracker.ari == 1.0
