import numpy as np
import pytest

from fedcond.config import RunConfig
from fedcond.datasets import load_dataset
from fedcond.errors import FedcondError
from fedcond.scenarios import build_scenario


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.mark.parametrize(("clusters", "clients"), [(3, 5), (5, 4), (10, 2), (1, 3)])
def test_label_shift_partitions_are_disjoint_complete_and_cluster_pure(digits, clusters, clients):
    scenario = build_scenario(digits, RunConfig(num_clusters=clusters, clients_per_cluster=clients))
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
    first = build_scenario(digits, RunConfig(seed=1))
    again = build_scenario(digits, RunConfig(seed=1))
    other = build_scenario(digits, RunConfig(seed=2))
    np.testing.assert_array_equal(first.clients[0].train_indices, again.clients[0].train_indices)
    assert not np.array_equal(first.clients[0].train_indices, other.clients[0].train_indices)


def test_more_clusters_than_classes_is_refused(digits):
    with pytest.raises(FedcondError, match="lower num-clusters"):
        build_scenario(digits, RunConfig(num_clusters=11))


def test_too_many_clients_for_the_data_is_refused(digits):
    with pytest.raises(FedcondError, match="lower clients-per-cluster"):
        build_scenario(digits, RunConfig(num_clusters=10, clients_per_cluster=200))


def test_summary_describes_clusters_and_sizes(digits):
    summary = build_scenario(digits, RunConfig(num_clusters=3, clients_per_cluster=5)).summary()
    assert summary["clusters"] == ["classes 0,1,2,3", "classes 4,5,6", "classes 7,8,9"]
    assert summary["num_clients"] == 15
    assert summary["train_samples_per_client"]["min"] >= 50
