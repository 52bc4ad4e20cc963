"""pFedHN (fedcond.hypernetwork, strategies.pfedhn): each client is served the model its embedding
generates, the server's step moves that model towards what the client returned, a newcomer gets the
mean embedding's model, and the hypernetwork survives a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import parameters_to_ndarrays

from fedcond.hypernetwork import HyperNetwork, HyperNetworkTrainer
from tests.test_method_rules import reply, strategy_for


def distance(first: list[np.ndarray], second: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a.astype(np.float64) - b) ** 2) for a, b in zip(first, second, strict=True))))


def template() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=5).astype(np.float32), np.array(7, np.int64)]


def test_each_client_gets_its_own_model_of_the_targets_shapes_and_integers_stay():
    net = HyperNetwork(template(), num_clients=3, embedding_dim=2, hidden=8)
    models = [net.weights_for(client) for client in (0, 1, None)]
    for model in models:
        assert [a.shape for a in model] == [a.shape for a in template()] and model[2] == 7
        assert [a.dtype for a in model] == [a.dtype for a in template()]
    assert distance(models[0], models[1]) > 0  # two embeddings, two models


def test_the_servers_step_moves_the_clients_generated_model_towards_what_it_returned():
    net = HyperNetwork(template(), num_clients=3, embedding_dim=2, hidden=8)
    trainer = HyperNetworkTrainer(net, learning_rate=0.01)
    sent = net.weights_for(0)
    returned = [array + 0.5 if array.dtype.kind == "f" else array for array in sent]
    other_before = net.weights_for(1)
    trainer.step(0, sent, returned)
    assert distance(net.weights_for(0), returned) < distance(sent, returned)
    assert distance(net.weights_for(1), other_before) > 0  # the shared hypernetwork moved too


def test_the_strategy_serves_participants_their_model_and_a_newcomer_the_mean_embeddings():
    strategy = strategy_for("pfedhn", held_out_clients=1)
    net = strategy.trainer.net
    for pid in range(4):
        served = parameters_to_ndarrays(strategy.fit_parameters(pid, None))
        assert distance(served, net.weights_for(pid)) == 0
        strategy.combine(1, [(pid, reply([a * 0.9 for a in served], 10))])
    newcomer = parameters_to_ndarrays(strategy.evaluate_parameters(4, None))  # held-out partitions 4, 5
    assert distance(newcomer, net.weights_for(None)) == 0 and distance(newcomer, net.weights_for(0)) > 0


def test_the_hypernetwork_and_its_momentum_survive_a_checkpoint():
    first, second = strategy_for("pfedhn"), strategy_for("pfedhn")
    served = parameters_to_ndarrays(first.fit_parameters(2, None))
    first.combine(1, [(2, reply([a * 0.5 for a in served], 10))])
    models, values = first.state()
    second.load_state(models, values)
    assert distance(first.trainer.net.weights_for(2), second.trainer.net.weights_for(2)) == 0
    for strategy in (first, second):  # the same next step: the momentum came back too
        again = parameters_to_ndarrays(strategy.fit_parameters(2, None))
        strategy.combine(2, [(2, reply([a * 0.5 for a in again], 10))])
    assert distance(first.trainer.net.weights_for(2), second.trainer.net.weights_for(2)) == pytest.approx(0)


def test_an_embedding_of_size_0_is_refused_in_one_line():
    from fedcond.errors import FedcondError
    from strategies.registry import run_config

    with pytest.raises(FedcondError, match="pfedhn-embedding-dim must be at least 1") as error:
        run_config({"method": "pfedhn", "pfedhn-embedding-dim": 0})
    assert "\n" not in str(error.value)
