"""The core rule of every method on tiny hand-made cases, without Flower."""

import numpy as np
import pytest

from fedcond.errors import FedcondError
from fedcond.model import aggregation as agg
from fedcond.model.networks import build_model, get_weights
from fedcond.model.training import ProximalTerm, TrainSettings, train


def model(*values):
    """A two-layer 'model' whose layers are filled with the given values."""
    return [np.full((2, 2), values[0], dtype=float), np.full(3, values[1], dtype=float)]


def test_ifca_picks_the_lowest_loss_model_first_on_ties():
    assert agg.lowest_loss_choice([0.9, 0.2, 0.5]) == 1
    assert agg.lowest_loss_choice([0.3, 0.3, 0.5]) == 0
    with pytest.raises(FedcondError, match="not finite"):
        agg.lowest_loss_choice([0.3, np.nan])


def test_ifca_and_oracle_average_per_group_and_keep_unchosen_models():
    current = [model(0, 0), model(10, 10), model(20, 20)]
    updates = [model(1, 1), model(3, 3), model(7, 7)]
    result = agg.average_per_group(current, updates, groups=[0, 0, 2], counts=[1, 3, 5])
    np.testing.assert_allclose(result[0][0], 2.5)  # (1*1 + 3*3) / 4: weighted by samples
    np.testing.assert_allclose(result[1][1], 10)  # nobody chose model 1: unchanged
    np.testing.assert_allclose(result[2][0], 7)  # only the third client's update


def test_oracle_never_mixes_clusters():
    rng = np.random.default_rng(0)
    clusters = [0, 0, 1, 1, 2]
    updates = [model(*rng.random(2)) for _ in clusters]
    result = agg.average_per_group([model(0, 0)] * 3, updates, clusters, [1] * 5)
    for cluster in range(3):
        members = [updates[i] for i, c in enumerate(clusters) if c == cluster]
        np.testing.assert_allclose(result[cluster][0], np.mean([m[0] for m in members], axis=0))


def test_gossip_pairs_are_a_matching_and_averaging_preserves_the_mean():
    rng = np.random.default_rng(1)
    pairs = agg.random_pairs(7, rng)
    members = [client for pair in pairs for client in pair]
    assert len(pairs) == 3 and len(set(members)) == 6  # disjoint pairs, one client sits out
    models = [model(*rng.random(2)) for _ in range(7)]
    mixed = agg.gossip_average(models, pairs)
    for first, second in pairs:
        np.testing.assert_allclose(mixed[first][0], (models[first][0] + models[second][0]) / 2)
        np.testing.assert_allclose(mixed[first][1], mixed[second][1])
    for layer in range(2):
        np.testing.assert_allclose(np.mean([m[layer] for m in mixed], 0), np.mean([m[layer] for m in models], 0))


def test_dac_selects_top_k_by_cosine_similarity_and_averages_uniformly():
    a, b, c, d = [np.array([1.0, 0.0])], [np.array([0.9, 0.1])], [np.array([0.0, 1.0])], [np.array([0.1, 0.9])]
    similarity = agg.cosine_similarities([a, b, c, d], [True])
    np.testing.assert_allclose(np.diag(similarity), 1.0)
    assert agg.top_k_neighbours(similarity, 1) == [[1], [0], [3], [2]]
    assert agg.top_k_neighbours(similarity, 2)[0] == [1, 3]
    mixed = agg.neighbourhood_average([a, b, c, d], [[1], [0], [3], [2]])
    np.testing.assert_allclose(mixed[0][0], [0.95, 0.05])
    assert agg.top_k_neighbours(np.ones((3, 3)), 1) == [[1], [0], [0]]  # ties: lower index, deterministic


def client_of(method, partition_id=0):
    from flwr.common import Context, RecordDict

    from fedcond.config import RunConfig
    from fedcond.data.client_data import load_client_data
    from fedcond.federation.methods import get_method

    config = RunConfig(method=method, num_clusters=2, clients_per_cluster=2, local_epochs=1)
    chosen = get_method(method)
    context = Context(0, 0, {"partition-id": partition_id, "num-partitions": 4}, RecordDict(), {})
    return chosen.client(config, load_client_data(config, partition_id), context)


def test_every_method_shuffles_by_the_same_rule():
    # One batch-order seed per (run seed, round, partition), whichever method's client trains.
    seeds = {method: client_of(method, 1).round_seed({"server-round": 3}) for method in ("fedavg", "local", "ifca")}
    expected = int(np.random.SeedSequence([0, 3, 1]).generate_state(1)[0])
    assert set(seeds.values()) == {expected}


def test_one_averaging_rule_equals_flowers_fedavg():
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server.strategy.aggregate import aggregate_inplace

    rng = np.random.default_rng(3)
    models = [[rng.standard_normal((4, 3)).astype(np.float32), np.array(7, dtype=np.int64)] for _ in range(3)]
    counts = [588, 612, 17]
    results = [
        (None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(m), n, {}))
        for m, n in zip(models, counts, strict=True)
    ]
    for ours, flowers in zip(agg.weighted_average(models, counts), aggregate_inplace(results), strict=True):
        assert ours.dtype == flowers.dtype and np.array_equal(ours, flowers)


def test_local_never_mixes_anything():
    client = client_of("local")
    garbage = [np.full_like(w, 1e3) for w in get_weights(client.model)]
    weights, count, _ = client.fit(garbage, {"server-round": 1})
    assert weights == [] and count > 0  # nothing leaves the client
    first = client.kept.model("local-model", client.fresh_model)
    client.fit(garbage, {"server-round": 2})  # what the server sends is ignored
    second = client.kept.model("local-model", client.fresh_model)
    assert all(np.abs(w).max() < 100 for w in get_weights(second))
    assert any(not np.array_equal(a, b) for a, b in zip(get_weights(first), get_weights(second), strict=True))
    from fedcond.strategies.local import LocalStrategy

    from fedcond.federation.server_method import ServerMethod

    assert LocalStrategy.combine is ServerMethod.combine  # the server has nothing to combine


def test_ifca_client_trains_and_reports_the_lowest_loss_model():
    client = client_of("ifca")
    good = get_weights(client.model)
    broken = [np.zeros_like(w) for w in good]
    broken[-1] = np.array([50.0] + [0.0] * (len(broken[-1]) - 1), dtype=np.float32)  # always predicts class 0
    labels_are_class_0 = np.all(client.data.train_y == 0)
    _, _, metrics = client.fit([*broken, *good], {"server-round": 1})
    assert metrics["choice"] == (0 if labels_are_class_0 else 1)


def test_ditto_personal_step_includes_the_proximal_pull():
    rng = np.random.default_rng(2)
    images = rng.random((32, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 3, 32)
    anchor = build_model((1, 8, 8), 3, 0, seed=5)
    settings = TrainSettings(epochs=3, batch_size=8, learning_rate=0.05, momentum=0.0)

    def distance_after(strength):
        personal = build_model((1, 8, 8), 3, 0, seed=9)
        train(personal, images, labels, None, settings, seed=1, term=ProximalTerm(anchor, strength))
        return sum(np.sum((p - q) ** 2) for p, q in zip(get_weights(personal), get_weights(anchor), strict=True))

    start = sum(
        np.sum((p - q) ** 2)
        for p, q in zip(get_weights(build_model((1, 8, 8), 3, 0, seed=9)), get_weights(anchor), strict=True)
    )
    assert distance_after(5.0) < distance_after(0.0) < start * 1.5
    assert distance_after(5.0) < start  # a strong pull moves the personal model towards the global one

    # The penalty is exactly (lambda / 2) * ||w - w_global||^2.
    personal = build_model((1, 8, 8), 3, 0, seed=9)
    term = ProximalTerm(anchor, 2.0)
    assert float(term.penalty(personal)) == pytest.approx(start, rel=1e-5)
