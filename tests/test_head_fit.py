"""``head-fit = "ridge"`` (``fedcond/model/head_fit.py``): each client trains its generated output layer as a
plain layer and returns products of its fingerprint; the server ridge-fits the generator to them."""

import json
from collections import Counter

import numpy as np
import pytest
from fedcond.clients.conditional import ConditionalClient
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.supercore.differential_privacy import compute_clip_model_update

from fedcond.data.scenarios import scenario_for
from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.client_app import node_data
from fedcond.federation.messages import SERVER_ROUND
from fedcond.federation.methods import get_method, run_config
from fedcond.federation.server_method import StrategyInputs
from fedcond.federation.strategy import FedcondStrategy
from fedcond.model import head_fit
from fedcond.model.networks import build_run_model, get_weights, set_weights
from fedcond.model.training import train
from fedcond.tools.experiment import read_history
from fedcond.tools.in_process import InProcessNode, run_in_process

RIDGE = {
    "method": "conditional", "dataset": "digits", "num-clusters": 3, "clients-per-cluster": 2,
    "fingerprint": "class-mean", "conditioning": "hyper", "normalisation": "none", "head-fit": "ridge",
    "verbose": False,
}  # fmt: skip


def products(generator_shape, conditions, changes, weights):
    """The sample-weighted means of the clients' products, as the server receives them."""
    share = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    moment = sum(w * head_fit.client_products(c, dh)[0] for w, c, dh in zip(share, conditions, changes, strict=True))
    gram = sum(w * head_fit.client_products(c, dh)[1] for w, c, dh in zip(share, conditions, changes, strict=True))
    assert moment.shape == generator_shape
    return moment, gram


def test_the_ridge_step_gives_each_group_of_alike_fingerprints_its_own_mean_head_change():
    rng = np.random.default_rng(0)
    dim, classes, hidden = 6, 3, 4
    generator = rng.standard_normal((dim + 1, classes, hidden + 1))
    # Three groups of two clients; a group's clients share one fingerprint, the groups' are independent.
    group_conditions = [head_fit.augmented(rng.standard_normal(dim), 1 / np.sqrt(dim)) for _ in range(3)]
    conditions = [group_conditions[client // 2] for client in range(6)]
    changes = [rng.standard_normal((classes, hidden + 1)) for _ in range(6)]
    weights = [10, 30, 20, 20, 5, 15]
    moment, gram = products(generator.shape, conditions, changes, weights)
    fitted = head_fit.ridge_step(generator, moment, gram, 1e-9)
    for group in range(3):
        members = [2 * group, 2 * group + 1]
        expected = sum(weights[m] * changes[m] for m in members) / sum(weights[m] for m in members)
        moved = head_fit.generated_head(fitted, conditions[members[0]]) - head_fit.generated_head(
            generator, conditions[members[0]]
        )
        np.testing.assert_allclose(moved, expected, rtol=1e-6, atol=1e-6)
    # FedAvg's step on the same replies (the mean of s~ (x) dH added to G) mixes the groups' changes.
    averaged = generator + moment
    moved = head_fit.generated_head(averaged, conditions[0]) - head_fit.generated_head(generator, conditions[0])
    assert not np.allclose(moved, (10 * changes[0] + 30 * changes[1]) / 40, atol=1e-2)


def test_the_ridge_keeps_a_lone_clients_share_of_its_change():
    condition = head_fit.augmented(np.array([0.5, -1.0, 2.0]), 1.0)
    change = np.ones((2, 3))
    generator = np.zeros((4, 2, 3))
    moment, gram = head_fit.client_products(condition, change)
    fitted = head_fit.ridge_step(generator, moment, gram, 0.5)
    norm = condition @ condition
    np.testing.assert_allclose(head_fit.generated_head(fitted, condition), change * norm / (norm + 0.5), rtol=1e-12)


def test_the_client_trains_its_generated_head_as_a_plain_layer_and_returns_the_fits_products():
    config = run_config(RIDGE).resolved()
    model = build_run_model(config, 10, conditioned=True)
    sent = get_weights(model)  # hyper-init=random: every client's head differs from W0
    node = InProcessNode(config, 0, Counter())
    round_config = {SERVER_ROUND: 1}
    # The instruction's Gram matrix is zero; here 0.5 everywhere, to show the reply's is a change from it.
    size = len(sent[list(model.state_dict()).index(head_fit.GENERATOR)]) + 1
    instruction = [*sent, np.full((size, size), 0.5, dtype=np.float32)]
    reply = parameters_to_ndarrays(node.fit(FitIns(ndarrays_to_parameters(instruction), round_config), None, None)
                                   .parameters)  # fmt: skip
    assert len(reply) == len(sent) + 1

    client = ConditionalClient(config, node_data(node.context, config, 0), node.context)
    condition = head_fit.augmented(client.condition(round_config), model.condition_scale)
    np.testing.assert_allclose(reply[-1], 0.5 + np.outer(condition, condition), rtol=1e-6)

    # What the plain network (no generator) trains from the same trunk and the client's generated head.
    names = list(model.state_dict())
    indices = head_fit.head_indices(names)
    generator = head_fit.generator_of(*(sent[index] for index in indices))
    head = head_fit.generated_head(generator, condition)
    plain = build_run_model(config, 10, conditioned=False)
    start = {name: array for name, array in zip(names, sent, strict=True)}
    start[head_fit.HEAD_WEIGHT], start[head_fit.HEAD_BIAS] = head[:, :-1], head[:, -1]
    set_weights(plain, [start[name].astype(np.float32) for name in plain.state_dict()])
    train(plain, client.data.train_x, client.data.train_y, None, client.train_settings, client.round_seed(round_config))
    trained = dict(zip(plain.state_dict(), get_weights(plain), strict=True))
    for name, array in zip(names, reply, strict=False):
        if name not in head_fit.HEAD_ARRAYS:
            np.testing.assert_allclose(array, trained[name], rtol=1e-5, atol=1e-6, err_msg=name)
    change = head_fit.generator_of(trained[head_fit.HEAD_WEIGHT], trained[head_fit.HEAD_BIAS], generator[1:0])[0] - head
    moment = head_fit.generator_of(*(reply[index] for index in indices)) - generator  # a change from what was sent
    np.testing.assert_allclose(moment, np.multiply.outer(condition, change), rtol=1e-3, atol=1e-5)
    # So Flower's client-side clipping (client-level DP), which clips reply minus instruction, scales the
    # trunk's update and both products alike: nothing of the reply escapes it.
    clipped = [array.copy() for array in reply]
    compute_clip_model_update(clipped, instruction, 0.01)
    scale = 0.01 / np.sqrt(sum(np.sum((np.float64(r) - i) ** 2) for r, i in zip(reply, instruction, strict=True)))
    np.testing.assert_allclose(clipped[-1], instruction[-1] + scale * (reply[-1] - instruction[-1]), rtol=1e-4)
    np.testing.assert_allclose(head_fit.generator_of(*(clipped[index] for index in indices)) - generator,
                               scale * moment, rtol=1e-3, atol=1e-8)  # fmt: skip
    # The client's reusable model keeps training its generator in other runs: nothing stays frozen.
    assert all(parameter.requires_grad for parameter in client.model.parameters())


def test_the_server_fits_the_generator_and_averages_the_rest_of_the_model():
    config = run_config(RIDGE)
    check_run(config)
    method = get_method("conditional")
    inputs = StrategyInputs(config, 10, True, None, scenario=scenario_for(config))
    strategy = FedcondStrategy(method.strategy(inputs)).method
    current = parameters_to_ndarrays(strategy.initial_global())
    indices = head_fit.head_indices(strategy.array_names)
    rng = np.random.default_rng(1)
    generator = head_fit.generator_of(*(current[index] for index in indices))
    conditions = [head_fit.augmented(rng.standard_normal(len(generator) - 1), 1.0) for _ in range(2)]
    changes = [rng.standard_normal(generator.shape[1:]) * 0.01 for _ in range(2)]
    replies = []
    for offset, condition, change in zip((1.0, 3.0), conditions, changes, strict=True):
        moment, gram = head_fit.client_products(condition, change)
        model = [array + offset for array in current]
        for index, array in zip(indices, head_fit.generator_arrays(generator + moment, np.float32), strict=True):
            model[index] = array
        replies.append([*model, gram.astype(np.float32)])
    results = [(p, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(r), 10, {})) for p, r in enumerate(replies)]
    new = parameters_to_ndarrays(strategy.combine(1, results))
    assert len(new) == len(current)
    for index, (before, after) in enumerate(zip(current, new, strict=True)):
        if index not in indices and after.dtype.kind == "f":
            np.testing.assert_allclose(after, before + 2.0, rtol=1e-5)  # the mean of +1 and +3
    fitted = head_fit.generator_of(*(new[index] for index in indices))
    expected = head_fit.ridge_step(generator, *products(generator.shape, conditions, changes, [10, 10]), 0.1)
    np.testing.assert_allclose(fitted, expected, rtol=1e-4, atol=1e-6)
    # A reply without the Gram matrix (a client not fitting by ridge) is refused in one line.
    with pytest.raises(FedcondError, match="server and clients disagree on head-fit"):
        strategy.combine(2, [(0, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(current), 10, {}))])


def test_the_noisy_step_moves_the_generator_along_the_directions_the_gram_holds_above_its_noise():
    rng = np.random.default_rng(4)
    size, noise = 6, 0.01
    # Two fingerprint directions carry the clients' signal; the other four hold noise alone.
    basis = np.linalg.qr(rng.standard_normal((size, size)))[0]
    gram = basis[:, :2] @ np.diag([1.0, 0.5]) @ basis[:, :2].T + noise * rng.standard_normal((size, size))
    generator, moment = rng.standard_normal((size, 3, 4)), rng.standard_normal((size, 3, 4))
    stepped = head_fit.noisy_ridge_step(generator, moment, gram, 0.1, noise)
    change = (stepped - generator).reshape(size, -1)
    # Nothing moves along the noise's directions; along the signal's, the noise-free fit's change there.
    assert np.abs(basis[:, 2:].T @ change).max() < 0.05 * np.abs(change).max()
    signal = basis[:, :2].T @ moment.reshape(size, -1) / np.array([[1.1], [0.6]])  # (eigenvalue + ridge)^-1
    np.testing.assert_allclose(basis[:, :2].T @ change, signal, rtol=0.05, atol=0.05)
    # Without the cut, the noise's directions take the most of the step: (small + 0.1)^-1 ~ 10.
    exact = (head_fit.ridge_step(generator, moment, (gram + gram.T) / 2, 0.1) - generator).reshape(size, -1)
    assert np.linalg.norm(basis[:, 2:].T @ exact) > np.linalg.norm(basis[:, :2].T @ exact)


def test_under_client_level_dp_the_fit_reads_the_noised_means_then_steps():
    from fedcond.federation.client_dp import noise_std_on_the_mean, with_client_dp

    settings = {**RIDGE, "client-dp": "client-side", "client-dp-noise-multiplier": 0.5, "server-momentum": 0.5}
    config = run_config(settings)
    check_run(config)  # accepted before anything starts, FedAvgM included
    inputs = StrategyInputs(config, 10, True, None, scenario=scenario_for(config))
    strategy = FedcondStrategy(get_method("conditional").strategy(inputs))
    method = strategy.method
    wrapper = with_client_dp(strategy, config)
    current = list(method.current)
    indices = head_fit.head_indices(method.array_names)
    generator = head_fit.generator_of(*(current[index] for index in indices))
    rng = np.random.default_rng(3)
    moment = rng.standard_normal(generator.shape) * 0.01
    noised_gram = rng.standard_normal((len(generator), len(generator)))  # noise: neither symmetric nor PSD
    mean = [array + 0.25 if array.dtype.kind == "f" else array for array in current]
    for index, array in zip(indices, head_fit.generator_arrays(generator + moment, np.float32), strict=True):
        mean[index] = array
    # The wrapper's step after its noise: the fit from the noised means, the rest averaged, then FedAvgM
    # (its first step from the model sent, velocity 0: the mean itself).
    new = parameters_to_ndarrays(wrapper.stepped_after_noise(ndarrays_to_parameters([*mean, noised_gram])))
    assert len(new) == len(current)
    noise = noise_std_on_the_mean(config)
    assert noise == pytest.approx(0.5 * 1.0 / 6)
    fitted = head_fit.noisy_ridge_step(generator, moment, noised_gram, 0.1, noise)
    np.testing.assert_allclose(head_fit.generator_of(*(new[index] for index in indices)), fitted, rtol=1e-3,
                               atol=1e-5)  # fmt: skip
    trunk = next(index for index, array in enumerate(current) if index not in indices and array.dtype.kind == "f")
    np.testing.assert_allclose(new[trunk], current[trunk] + 0.25, rtol=1e-5)


def test_a_ridge_run_under_client_level_dp_trains_and_accounts(tmp_path):
    # A clip far above the updates and little noise: the path (layout, clip, noise, fit) with a model that learns.
    config = run_config({**RIDGE, "num-server-rounds": 2, "results-dir": str(tmp_path), "client-dp": "client-side",
                         "client-dp-noise-multiplier": 0.001, "client-dp-clipping-norm": 10.0})  # fmt: skip
    recorder, _ = run_in_process(config)
    rows = read_history(recorder.folder / "history.csv")
    assert [row["round"] for row in rows] == ["1", "2"] and float(rows[-1]["accuracy"]) > 0.2
    info = json.loads((recorder.folder / "run.json").read_text())
    assert info["status"] == "finished" and info["privacy"]["client_level"]["epsilon_by_round"][-1] > 0


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"conditioning": "concat"}, "set conditioning=hyper, or head-fit=average"),
        ({"head-fit": "exact"}, "unknown head-fit 'exact'; choose one of average, ridge"),
        ({"head-fit-ridge": 0.0}, "head-fit-ridge must be positive"),
        ({"client-dp": "server-side"}, "no head-fit=ridge Gram matrix; use client-dp=client-side"),
    ],
)
def test_a_head_fit_that_cannot_apply_is_refused_in_one_line(settings, refusal):
    with pytest.raises(FedcondError, match=refusal):
        check_run(run_config({**RIDGE, **settings}))


def test_a_ridge_run_trains_and_differs_from_the_averaged_generator(tmp_path):
    rows = {}
    for fit in ("average", "ridge"):
        config = run_config({**RIDGE, "num-server-rounds": 2, "head-fit": fit, "results-dir": str(tmp_path),
                             "run-name": fit})  # fmt: skip
        recorder, _ = run_in_process(config)
        rows[fit] = read_history(recorder.folder / "history.csv")
    assert [row["round"] for row in rows["ridge"]] == ["1", "2"]
    assert rows["ridge"][-1]["accuracy"] != rows["average"][-1]["accuracy"]
    assert float(rows["ridge"][-1]["accuracy"]) > 0.3


@pytest.mark.slow
def test_secaggplus_gives_the_server_the_fits_means_and_no_clients_own():
    from tests.secagg_harness import InProcessGrid, secure_round

    federation = {**RIDGE, "num-clusters": 2, "condition-scale": "unit"}
    config = run_config({**federation, "secure-aggregation": "secaggplus"}).resolved()
    check_run(config)
    model = build_run_model(config, 10, conditioned=True)
    sent = get_weights(model)
    size = len(sent[list(model.state_dict()).index(head_fit.GENERATOR)]) + 1
    round_config = {SERVER_ROUND: 1}
    instruction = [*sent, np.zeros((size, size), dtype=np.float32)]  # the server's training instruction
    outcome = secure_round(InProcessGrid(config), config, range(config.num_training_clients), instruction,
                           round_config)  # fmt: skip
    assert outcome.contributors == list(range(config.num_training_clients))
    *model, gram, _loss = outcome.mean
    assert len(model) == len(sent)
    grams, counts = [], []
    for partition in outcome.contributors:
        node = InProcessNode(run_config(federation).resolved(), partition, Counter())
        client = ConditionalClient(config, node_data(node.context, config, partition), node.context)
        condition = head_fit.augmented(client.condition(round_config), client.model.condition_scale)
        grams.append(np.outer(condition, condition))
        counts.append(len(client.data.train_y))
    # Stochastic rounding to 2 x clipping-range / quantization-range per client: the Gram's mean is exact to it.
    np.testing.assert_allclose(gram, np.average(grams, axis=0, weights=counts), atol=1e-4)


def test_one_clients_products_give_its_fingerprint_and_head_change_exactly():
    """What head_fit's docstring says a reply in the clear gives away: s~_0 = 1, so row 0 of s~ s~^T is
    [1, c] (the fingerprint as the model reads it, sign included) and row 0 of s~ (x) dH is dH."""
    condition = np.array([0.3, -1.2, 2.0], dtype=np.float32)
    change = np.random.default_rng(0).normal(size=(10, 5)).astype(np.float32)
    moment, gram = head_fit.client_products(head_fit.augmented(condition, 1.0), change)
    assert np.allclose(gram[0, 1:], condition) and gram[0, 0] == 1.0
    assert np.allclose(moment[0], change)
