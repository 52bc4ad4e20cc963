import numpy as np
import pytest

from fedcond.config import RunConfig
from fedcond.data.datasets import load_dataset
from fedcond.data.scenarios import build_scenario
from fedcond.errors import FedcondError


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.mark.parametrize(("clusters", "clients"), [(3, 5), (5, 4), (10, 2), (1, 3)])
def test_label_shift_partitions_are_disjoint_complete_and_cluster_pure(digits, clusters, clients):
    scenario = build_scenario(RunConfig(num_clusters=clusters, clients_per_cluster=clients))
    assert len(scenario.clients) == clusters * clients
    groups = np.array_split(np.arange(10), clusters)
    for split, labels in (("train", digits.train_y), ("test", digits.test_y)):
        all_indices = np.concatenate([getattr(c, f"{split}_indices") for c in scenario.clients])
        assert len(all_indices) == len(np.unique(all_indices)), "a sample is held by two clients"
        for cluster, classes in enumerate(groups):
            held = np.concatenate([getattr(c, f"{split}_indices") for c in scenario.clients if c.cluster == cluster])
            # The cluster's clients together hold exactly the cluster's samples, nothing else.
            np.testing.assert_array_equal(np.sort(held), np.flatnonzero(np.isin(labels, classes)))
    for client in scenario.clients:
        assert client.cluster == client.partition_id // clients
        assert set(np.unique(digits.test_y[client.test_indices])) <= set(groups[client.cluster])


def test_same_seed_same_split_other_seed_other_split(digits):
    first = build_scenario(RunConfig(seed=1))
    again = build_scenario(RunConfig(seed=1))
    other = build_scenario(RunConfig(seed=2))
    np.testing.assert_array_equal(first.clients[0].train_indices, again.clients[0].train_indices)
    assert not np.array_equal(first.clients[0].train_indices, other.clients[0].train_indices)


def test_more_clusters_than_classes_is_refused(digits):
    with pytest.raises(FedcondError, match="lower num-clusters"):
        build_scenario(RunConfig(num_clusters=11))


def test_too_many_clients_for_the_data_is_refused(digits):
    with pytest.raises(FedcondError, match="lower clients-per-cluster"):
        build_scenario(RunConfig(num_clusters=10, clients_per_cluster=200))


def test_summary_describes_clusters_and_sizes(digits):
    summary = build_scenario(RunConfig(num_clusters=3, clients_per_cluster=5)).summary()
    assert summary["clusters"] == ["classes 0,1,2,3", "classes 4,5,6", "classes 7,8,9"]
    assert summary["num_clients"] == 15
    assert summary["train_samples_per_client"]["min"] >= 50


def all_indices(scenario, split):
    return np.concatenate([getattr(c, f"{split}_indices") for c in scenario.clients])


@pytest.mark.parametrize(("rotations", "angles"), [("C1", [0, 180]), ("C4", [0, 10, 180, 350]), ("", [0, 120, 240])])
def test_rotation_clusters_share_the_data_disjointly_with_their_angles(rotations, angles):
    config = RunConfig(
        scenario="covariate-rotation", rotations=rotations, num_clusters=len(angles), clients_per_cluster=2
    )
    scenario = build_scenario(config)
    assert sorted({c.rotation for c in scenario.clients}) == sorted(float(a) for a in angles)
    for split, size in (("train", 898), ("test", 899)):
        indices = all_indices(scenario, split)
        assert len(indices) == len(np.unique(indices)) == size  # every sample, once
    assert all(c.rotation == float(angles[c.cluster]) for c in scenario.clients)


def test_rotated_client_data_is_rotated_and_labels_unchanged(digits):
    from fedcond.data.client_data import load_client_data

    config = RunConfig(scenario="covariate-rotation", rotations="0,90", num_clusters=2, clients_per_cluster=2)
    partition = build_scenario(config).clients[2]  # cluster 1: 90 degrees
    data = load_client_data(config, 2)
    np.testing.assert_array_equal(data.train_x, np.rot90(digits.train_x[partition.train_indices], 1, axes=(2, 3)))
    np.testing.assert_array_equal(data.train_y, digits.train_y[partition.train_indices])
    # The client's test set follows its own distribution: rotated the same way.
    np.testing.assert_array_equal(data.test_x, np.rot90(digits.test_x[partition.test_indices], 1, axes=(2, 3)))


@pytest.mark.parametrize(
    ("rotations", "message"), [("0,ninety", "comma-separated degrees"), ("C3", "set num-clusters=4")]
)
def test_bad_rotation_settings_are_refused(rotations, message):
    with pytest.raises(FedcondError, match=message):
        build_scenario(RunConfig(scenario="covariate-rotation", rotations=rotations, num_clusters=2))


def test_permutation_clusters_have_their_own_seeded_label_permutation(digits):
    config = RunConfig(scenario="concept-permutation", num_clusters=3, clients_per_cluster=2, seed=4)
    scenario = build_scenario(config)
    maps = {c.cluster: tuple(c.label_map) for c in scenario.clients}
    assert len(set(maps.values())) == 3 and all(sorted(m) == list(range(10)) for m in maps.values())
    assert maps == {c.cluster: tuple(c.label_map) for c in build_scenario(config).clients}  # same seed
    from fedcond.data.client_data import load_client_data

    data = load_client_data(config, 5)
    partition = scenario.clients[5]
    np.testing.assert_array_equal(data.test_y, partition.label_map[digits.test_y[partition.test_indices]])
    with pytest.raises(FedcondError, match=r"2\.\.5"):
        build_scenario(RunConfig(scenario="concept-permutation", num_clusters=6))


def test_data_fraction_subsamples_every_cluster():
    full = build_scenario(RunConfig(scenario="label-shift", num_clusters=2, clients_per_cluster=2))
    tenth = build_scenario(RunConfig(scenario="label-shift", num_clusters=2, clients_per_cluster=2, data_fraction=0.1))
    assert len(all_indices(tenth, "train")) == pytest.approx(0.1 * len(all_indices(full, "train")), abs=2)
    assert set(all_indices(tenth, "train")) <= set(all_indices(full, "train"))
    assert tenth.summary()["data_fraction"] == 0.1


@pytest.fixture
def fake_idx_data(tmp_path):
    from tests.test_datasets import write_fake_mnist

    write_fake_mnist(tmp_path / "mnist", train=60, test=40)
    write_fake_mnist(tmp_path / "fashion-mnist", train=50, test=30)
    return tmp_path


def test_semantic_clusters_relabel_by_their_grouping(fake_idx_data):
    from fedcond.data.client_data import load_client_data

    config = RunConfig(scenario="concept-semantic", dataset="mnist", num_clusters=2, clients_per_cluster=2,
                       data_dir=str(fake_idx_data))  # fmt: skip
    scenario = build_scenario(config)
    assert scenario.num_classes == 2 and scenario.cluster_descriptions == ("labels odd/even", "labels below-5/above-5")
    raw = load_dataset("mnist", fake_idx_data)
    for partition_id, rule in ((0, lambda y: y % 2), (3, lambda y: (y >= 5).astype(int))):
        data = load_client_data(config, partition_id)
        np.testing.assert_array_equal(data.train_y, rule(raw.train_y[scenario.clients[partition_id].train_indices]))
    with pytest.raises(FedcondError, match="change dataset"):
        build_scenario(RunConfig(scenario="concept-semantic", num_clusters=2))


def test_domain_clusters_are_mnist_and_fashion_mnist(fake_idx_data):
    config = RunConfig(scenario="domain", dataset="mnist", num_clusters=2, clients_per_cluster=3,
                       data_dir=str(fake_idx_data))  # fmt: skip
    scenario = build_scenario(config)
    assert [c.source for c in scenario.clients] == ["mnist"] * 3 + ["fashion-mnist"] * 3
    assert sum(len(c.train_indices) for c in scenario.clients if c.source == "fashion-mnist") == 50
    with pytest.raises(FedcondError, match="num-clusters=2"):
        build_scenario(config.replace(num_clusters=3))


def test_printed_summary_names_every_cluster_and_the_sizes():
    from fedcond.data.scenarios import format_summary

    text = format_summary(
        build_scenario(RunConfig(scenario="covariate-rotation", rotations="C1", num_clusters=2)).summary()
    )
    assert "cluster 0: rotated 0 degrees" in text and "cluster 1: rotated 180 degrees" in text
    assert "2 clusters x 5 clients" in text and "samples per client (min/median/max): train 89/90/90" in text


@pytest.mark.parametrize("scenario", ["label-shift", "concept-permutation"])
def test_held_out_clients_come_after_training_clients_with_their_clusters_data(digits, scenario):
    config = RunConfig(scenario=scenario, num_clusters=2, clients_per_cluster=3, held_out_clients=1)
    built = build_scenario(config)
    assert len(built.clients) == 8 and [c.partition_id for c in built.clients] == list(range(8))
    training, held_out = built.clients[:6], built.clients[6:]
    assert not any(c.held_out for c in training) and all(c.held_out for c in held_out)
    assert [c.cluster for c in held_out] == [0, 1]  # one per cluster
    for client in held_out:
        same_cluster = [c for c in training if c.cluster == client.cluster]
        assert np.array_equal(client.label_map, same_cluster[0].label_map)
        for other in same_cluster:
            assert not set(client.train_indices) & set(other.train_indices)
    assert built.summary()["clients_per_cluster"] == 3 and built.summary()["held_out_clients_per_cluster"] == 1
    # Without held-out clients the split is unchanged (same ids, same samples as before the feature).
    plain = build_scenario(config.replace(held_out_clients=0))
    assert len(plain.clients) == 6 and not any(c.held_out for c in plain.clients)


# -- no clusters: the field's partitioners (flwr-datasets) ---------------------------------------------
def label_mixes(scenario, dataset):
    """Each client's train and test label counts."""
    return [
        (np.bincount(dataset.train_y[c.train_indices], minlength=10), np.bincount(dataset.test_y[c.test_indices],
                                                                                  minlength=10))
        for c in scenario.clients
    ]  # fmt: skip


def test_a_dirichlet_split_is_disjoint_follows_alpha_and_tests_each_client_on_its_own_label_mix(digits):
    entropies = {}
    for alpha in (0.1, 10.0):
        config = RunConfig(scenario="dirichlet", num_clusters=1, clients_per_cluster=8, held_out_clients=2,
                           dirichlet_alpha=alpha)  # fmt: skip
        scenario = build_scenario(config)
        assert len(scenario.clients) == 10 and [c.held_out for c in scenario.clients] == [False] * 8 + [True] * 2
        trains = np.concatenate([c.train_indices for c in scenario.clients])
        tests = np.concatenate([c.test_indices for c in scenario.clients])
        assert len(trains) == len(np.unique(trains)) == len(digits.train_y)  # disjoint, complete
        assert len(tests) == len(np.unique(tests)) == len(digits.test_y)
        mixes = label_mixes(scenario, digits)
        for train, test in mixes:
            assert np.all(test[train == 0] == 0)  # no client is tested on a class it never trained on
        shares = [train / train.sum() for train, _ in mixes]
        entropies[alpha] = np.mean([-(p[p > 0] * np.log(p[p > 0])).sum() for p in shares])
        assert {c.cluster for c in scenario.clients} == {0}
    assert entropies[0.1] < entropies[10.0] - 0.5  # smaller alpha: more skewed clients


def test_a_pathological_split_gives_each_client_exactly_its_classes(digits):
    config = RunConfig(scenario="pathological", num_clusters=1, clients_per_cluster=10, classes_per_client=2)
    for train, test in label_mixes(build_scenario(config), digits):
        assert np.count_nonzero(train) == 2 and set(np.flatnonzero(test)) <= set(np.flatnonzero(train))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"scenario": "dirichlet", "num_clusters": 2}, "dirichlet has no clusters .* set num-clusters=1"),
        ({"scenario": "pathological", "num_clusters": 1, "classes_per_client": 11},
         "classes-per-client=11 is more than the 10 classes of digits"),
    ],
)  # fmt: skip
def test_a_partition_without_clusters_is_refused_in_one_line_where_it_cannot_be(digits, settings, message):
    with pytest.raises(FedcondError, match=message):
        build_scenario(RunConfig(**settings))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "oracle"}, "oracle is told the true clusters, and dirichlet has none"),
        ({"method": "pooled-oracle"}, "pooled-oracle is told the true clusters"),
        ({"fingerprint": "cluster-id"}, "fingerprint cluster-id is the true cluster, and dirichlet has none"),
        ({"method": "ifca"}, "IFCA with one cluster model is FedAvg; give ifca-models=K"),
        ({"dirichlet-alpha": 0}, "dirichlet-alpha must be positive and finite"),
    ],
)
def test_what_needs_true_clusters_is_refused_on_a_partition_without_them(settings, message):
    from fedcond.federation.checks import check_run
    from fedcond.federation.methods import run_config

    with pytest.raises(FedcondError, match=message):
        check_run(run_config({"scenario": "dirichlet", "num-clusters": 1, "clients-per-cluster": 6, **settings}))
    check_run(run_config({"scenario": "dirichlet", "num-clusters": 1, "method": "ifca", "ifca-models": 3}))


def test_only_a_partitioners_own_setting_keys_its_split():
    from fedcond.data.scenarios import split_settings

    assert "dirichlet-alpha" in split_settings(RunConfig(scenario="dirichlet", num_clusters=1))
    assert "dirichlet-alpha" not in split_settings(RunConfig())  # partition files of other splits stay valid
    assert "classes-per-client" in split_settings(RunConfig(scenario="pathological", num_clusters=1))
