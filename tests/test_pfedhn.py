"""pFedHN (fedcond.model.hypernetwork, fedcond.strategies.pfedhn): each client is served the model its embedding
generates, the server's step moves that model towards what the client returned, a newcomer gets the
mean embedding's model and learns an embedding of its own with the hypernetwork frozen, and the
hypernetwork survives a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.common import parameters_to_ndarrays

from fedcond.federation.participation import EVALUATE, FIT
from fedcond.model.hypernetwork import HyperNetwork, HyperNetworkTrainer, NewcomerEmbedding
from fedcond.model.networks import get_weights
from tests.test_method_rules import reply, strategy_for


def distance(first: list[np.ndarray], second: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a.astype(np.float64) - b) ** 2) for a, b in zip(first, second, strict=True))))


def target():
    """A linear layer and a batch norm: 4 parameters and 3 buffers (mean, variance, step counter)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].num_batches_tracked.fill_(7)
    return model


def template() -> list[np.ndarray]:
    return get_weights(target())


RUNNING_MEAN, RUNNING_VAR, STEP_COUNTER = 4, 5, 6  # their places in get_weights' order


def test_each_client_gets_its_own_model_of_the_targets_shapes_and_integers_stay():
    net = HyperNetwork(target(), num_clients=3, embedding_dim=2, hidden=8)
    models = [net.weights_for(client) for client in (0, 1, None)]
    for model in models:
        assert [a.shape for a in model] == [a.shape for a in template()] and model[STEP_COUNTER] == 7
        assert [a.dtype for a in model] == [a.dtype for a in template()]
    assert distance(models[0], models[1]) > 0  # two embeddings, two models


def test_batch_norm_statistics_are_not_generated_a_client_gets_the_ones_it_returned_a_newcomer_their_mean():
    """Generated and stepped like weights, a running variance went negative (CIFAR-10's NaN)."""
    net = HyperNetwork(target(), num_clients=3, embedding_dim=2, hidden=8)
    assert len(net.heads) == 4  # the parameters only
    trainer = HyperNetworkTrainer(net, learning_rate=0.01)
    initial = template()
    for client, variance in ((0, 0.5), (1, 2.5)):
        returned = [np.array(array, copy=True) for array in net.weights_for(client)]
        returned[RUNNING_MEAN] += 1.0
        returned[RUNNING_VAR] = np.full(4, variance, np.float32)
        returned[STEP_COUNTER] = np.array(9)
        trainer.step(client, net.weights_for(client), returned)
        assert np.array_equal(net.weights_for(client)[RUNNING_VAR], returned[RUNNING_VAR])
        assert net.weights_for(client)[STEP_COUNTER] == 9
    assert np.array_equal(net.weights_for(2)[RUNNING_VAR], initial[RUNNING_VAR])  # not trained yet
    newcomer = net.weights_for(None)
    assert np.allclose(newcomer[RUNNING_VAR], 1.5) and np.allclose(newcomer[RUNNING_MEAN], initial[RUNNING_MEAN] + 1)
    assert newcomer[STEP_COUNTER] == 7  # an integer buffer is the initial model's
    assert np.array_equal(NewcomerEmbedding(net, learning_rate=0.1).weights()[RUNNING_VAR], newcomer[RUNNING_VAR])


def test_the_servers_step_moves_the_clients_generated_model_towards_what_it_returned():
    net = HyperNetwork(target(), num_clients=3, embedding_dim=2, hidden=8)
    trainer = HyperNetworkTrainer(net, learning_rate=0.01)
    sent = net.weights_for(0)
    returned = [array + 0.5 if array.dtype.kind == "f" else array for array in sent]
    other_before = net.weights_for(1)
    trainer.step(0, sent, returned)
    assert distance(net.weights_for(0), returned) < distance(sent, returned)
    assert distance(net.weights_for(1), other_before) > 0  # the shared hypernetwork moved too


def test_a_round_mean_step_measures_every_update_from_the_hypernetwork_that_generated_it():
    """round-mean: one step along the mean of the clients' surrogates, each at the models they were
    sent (so the result does not depend on the order of the replies); per-client steps in turn."""
    import copy

    net = HyperNetwork(target(), num_clients=3, embedding_dim=2, hidden=8)
    updates = []
    for client, shift in ((0, 0.5), (1, -0.3)):
        sent = net.weights_for(client)
        updates.append((client, sent, [a + shift if a.dtype.kind == "f" else a for a in sent]))
    together, reversed_order, in_turn = copy.deepcopy(net), copy.deepcopy(net), copy.deepcopy(net)
    HyperNetworkTrainer(together, learning_rate=0.01).step_together(updates)
    HyperNetworkTrainer(reversed_order, learning_rate=0.01).step_together(updates[::-1])
    trainer = HyperNetworkTrainer(in_turn, learning_rate=0.01)
    for update in updates:
        trainer.step(*update)
    # One SGD step on the mean surrogate, by hand (no momentum yet; weight decay as the trainer's).
    expected = copy.deepcopy(net)
    surrogate = sum(expected.update_surrogate(expected.embedding(c), s, r) for c, s, r in updates) / 2
    surrogate.backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), 50.0)
    with torch.no_grad():
        for p in expected.parameters():
            p -= 0.01 * (p.grad + 1e-3 * p)

    def generated(network: HyperNetwork, client: int) -> list[np.ndarray]:
        return [network.weights_for(client)[i] for i in network.generated]  # buffers are kept, not stepped

    for client in (0, 1):
        assert distance(generated(together, client), generated(expected, client)) < 1e-5
        assert distance(generated(together, client), generated(reversed_order, client)) < 1e-5
        assert distance(generated(together, client), generated(in_turn, client)) > 1e-4


def test_the_strategy_serves_participants_their_model_and_a_newcomer_the_mean_embeddings():
    strategy = strategy_for("pfedhn", held_out_clients=1)
    net = strategy.trainer.net
    for pid in range(4):
        served = parameters_to_ndarrays(strategy.instruction(FIT, pid, None, {})[0])
        assert distance(served, net.weights_for(pid)) == 0
        strategy.combine(1, [(pid, reply([a * 0.9 for a in served], 10))])
    newcomer = parameters_to_ndarrays(strategy.instruction(EVALUATE, 4, None, {})[0])  # held-out partitions 4, 5
    assert distance(newcomer, net.weights_for(None)) == 0 and distance(newcomer, net.weights_for(0)) > 0


def test_a_newcomers_step_moves_its_own_embeddings_model_towards_what_it_returned_and_nothing_else():
    net = HyperNetwork(target(), num_clients=3, embedding_dim=2, hidden=8)
    with torch.no_grad():  # heads as a trained hypernetwork's, whose models depend on the embedding
        for head in net.heads:
            head.weight.mul_(100.0)
    frozen = [p.detach().clone() for p in net.parameters()]
    newcomer = NewcomerEmbedding(net, learning_rate=0.1)
    start = newcomer.weights()
    assert distance(start, net.weights_for(None)) == 0  # it starts at the mean embedding
    wanted = [array + 0.5 if array.dtype.kind == "f" else array for array in start]
    for _ in range(3):
        newcomer.step(newcomer.weights(), wanted)

    def generated(model: list[np.ndarray]) -> list[np.ndarray]:
        return [model[i] for i in net.generated]

    assert distance(generated(newcomer.weights()), generated(wanted)) < distance(generated(start), generated(wanted))
    assert all(torch.equal(p, before) for p, before in zip(net.parameters(), frozen, strict=True))
    assert all(p.grad is None or not p.grad.any() for p in net.parameters())


def test_a_newcomer_client_takes_one_step_per_exchange_and_scores_both_models():
    from fedcond.federation.messages import (
        ADAPTED_ACCURACY,
        NEWCOMER_STEP,
        PAYLOAD_PARTS,
        PFEDHN_NEWCOMER_PARTS,
        SERVER_ROUND,
        STEP,
        STEP_NEWCOMER_EMBEDDING,
        pack_parts,
    )
    from tests.test_method_rules import always_class, newcomer_of

    newcomer = newcomer_of("pfedhn", options=(("newcomer-steps", 2),))  # cluster 0's newcomer: classes 0-4
    wrong, right = always_class(newcomer, 9), always_class(newcomer, 0)
    step = {SERVER_ROUND: 1, STEP: STEP_NEWCOMER_EMBEDDING, NEWCOMER_STEP: 1}
    returned, examples, _ = newcomer.fit(wrong, step)
    assert examples == newcomer.train_settings.batch_size  # one batch: one SGD step
    assert returned[-1][9] < 50.0 and distance(returned[:-1], wrong[:-1]) == 0  # only the output bias moved
    arrays, names = pack_parts(dict(zip(PFEDHN_NEWCOMER_PARTS, (wrong, right), strict=True)))
    _, _, metrics = newcomer.evaluate(arrays, {SERVER_ROUND: 1, PAYLOAD_PARTS: names})
    assert metrics["accuracy"] == 0.0 and metrics[ADAPTED_ACCURACY] > 0  # zero-shot: says 9; learned: 0
    # By name, not by place: the same two models sent in the other order are read the same.
    swapped, names = pack_parts(dict(zip(reversed(PFEDHN_NEWCOMER_PARTS), (right, wrong), strict=True)))
    assert newcomer.evaluate(swapped, {SERVER_ROUND: 1, PAYLOAD_PARTS: names})[2] == metrics
    assert ADAPTED_ACCURACY not in newcomer.evaluate(wrong, {SERVER_ROUND: 1})[2]
    trainee = __import__("tests.test_method_rules", fromlist=["client_of"]).client_of("pfedhn", 0)
    assert "newcomer's embedding step" in trainee.fit(wrong, step)[2]["fedcond-error"]


def test_the_hypernetwork_and_its_momentum_survive_a_checkpoint():
    first, second = strategy_for("pfedhn"), strategy_for("pfedhn")
    served = parameters_to_ndarrays(first.instruction(FIT, 2, None, {})[0])
    first.combine(1, [(2, reply([a * 0.5 for a in served], 10))])
    models, values = first.state()
    second.load_state(models, values)
    assert distance(first.trainer.net.weights_for(2), second.trainer.net.weights_for(2)) == 0
    for strategy in (first, second):  # the same next step: the momentum came back too
        again = parameters_to_ndarrays(strategy.instruction(FIT, 2, None, {})[0])
        strategy.combine(2, [(2, reply([a * 0.5 for a in again], 10))])
    assert distance(first.trainer.net.weights_for(2), second.trainer.net.weights_for(2)) == pytest.approx(0)


def test_each_clients_batch_norm_statistics_survive_a_checkpoint(tmp_path):
    from fedcond.strategies.pfedhn import PFedHNStrategy

    from fedcond.config import RunConfig
    from fedcond.data.scenarios import scenario_for
    from fedcond.federation.server_method import StrategyInputs
    from fedcond.federation.strategy import FedcondStrategy
    from tests.test_cifar import write_cifar10_folder

    write_cifar10_folder(tmp_path / "cifar10-jpeg")  # fedcond's CIFAR CNN has batch norm
    config = RunConfig(method="pfedhn", dataset="cifar10", clients_per_cluster=2, data_dir=str(tmp_path))
    inputs = StrategyInputs(config, 10, False, None, scenario=scenario_for(config))
    first, second = FedcondStrategy(PFedHNStrategy(inputs)).method, FedcondStrategy(PFedHNStrategy(inputs)).method
    sent = first.trainer.net.weights_for(1)
    returned = [array * 0.5 if array.dtype.kind == "f" else array for array in sent]
    first.trainer.step(1, sent, returned)
    second.load_state(*first.state())
    assert distance(second.trainer.net.weights_for(1), first.trainer.net.weights_for(1)) == 0
    assert distance(second.trainer.net.weights_for(None), first.trainer.net.weights_for(None)) == 0


def test_an_embedding_of_size_0_and_dp_sgd_with_newcomer_steps_are_refused_in_one_line():
    from fedcond.errors import FedcondError
    from fedcond.federation.checks import check_run
    from fedcond.federation.methods import run_config

    with pytest.raises(FedcondError, match="pfedhn-embedding-dim must be at least 1") as error:
        run_config({"method": "pfedhn", "pfedhn-embedding-dim": 0})
    assert "\n" not in str(error.value)
    private = {"held-out-clients": 1, "newcomer-steps": 3, "dp-noise-multiplier": 1.0}
    with pytest.raises(FedcondError, match="a newcomer sends the server the update of each embedding step"):
        check_run(run_config({"method": "pfedhn", **private}), load_data=False)
    check_run(run_config({"method": "pfedhn", **private, "newcomer-steps": 0}), load_data=False)
    check_run(run_config({"method": "cfl", **private}), load_data=False)  # CFL's newcomers send nothing
    with pytest.raises(FedcondError, match=r"^pfedhn-step must be round-mean or per-client \(got 'mean'\)$"):
        check_run(run_config({"method": "pfedhn", "pfedhn-step": "mean"}), load_data=False)


def test_on_digits_its_newcomers_learned_embeddings_serve_them_better_than_the_mean_embedding(tmp_path):
    """Digits E1 K=2 x 3 clients and a newcomer each, 6 rounds (the first rounds' hypernetwork hardly
    depends on the embedding), 10 embedding steps a round: the newcomers' own embeddings' models beat
    the mean embedding's, and every exchange is counted (a model each way per step and newcomer)."""
    import csv

    from fedcond.federation.methods import run_config
    from fedcond.tools.flwr_commands import default_config
    from fedcond.tools.in_process import run_in_process

    config = run_config({
        **default_config(), "method": "pfedhn", "num-clusters": 2, "clients-per-cluster": 3, "held-out-clients": 1,
        "num-server-rounds": 6, "newcomer-steps": 10, "results-dir": str(tmp_path), "verbose": False,
    })  # fmt: skip
    recorder, messages = run_in_process(config)
    with (recorder.folder / "history.csv").open() as handle:
        last = list(csv.DictReader(handle))[-1]
    zero_shot, learned = float(last["heldout_accuracy"]), float(last["heldout_adapted_accuracy"])
    assert learned > zero_shot + 0.05, (zero_shot, learned)
    model_bytes = int(last["bytes_up"]) // (6 + 10 * 2)  # 6 fit replies, 10 steps of 2 newcomers
    assert int(last["bytes_up"]) == 26 * model_bytes and messages["fit"] == 6 * (6 + 20)
