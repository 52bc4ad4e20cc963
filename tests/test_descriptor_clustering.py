"""Descriptor clustering (fedcond.fingerprint.descriptor_clustering, fedcond.federation.cluster_models): DBSCAN finds K
itself, noise and newcomers go to the nearest centroid, a clustering that finds nothing is refused,
and with descriptors that recover the true clusters the method is Oracle, round for round."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from fedcond.errors import FedcondError
from fedcond.fingerprint.descriptor_clustering import DescriptorClusters, cluster_descriptors


def blobs(centres: list[float], per_blob: int, spread: float = 0.1, dim: int = 8, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.vstack([rng.normal(centre, spread, (per_blob, dim)) for centre in centres])


def test_dbscan_finds_the_number_of_clusters_itself_and_places_a_newcomer_at_the_nearest_centroid():
    descriptors = blobs([0.0, 3.0, -3.0], per_blob=4)
    found = cluster_descriptors(descriptors)
    assert found.count == 3 and found.noise == 0
    assert adjusted_rand_score(np.repeat([0, 1, 2], 4), found.labels) == 1.0
    newcomer = np.full(8, 2.9)  # beside the second blob
    assert found.assign(newcomer) == found.labels[4]


def test_without_structure_the_adaptive_radius_keeps_one_cluster():
    found = cluster_descriptors(np.random.default_rng(1).normal(0.0, 1.0, (12, 8)))
    assert found.count == 1 and set(found.labels) == {0}


def test_a_client_dbscan_leaves_as_noise_joins_the_nearest_cluster():
    # A stray near the second blob (not the first: a rule that always picked cluster 0 would pass then).
    descriptors = np.vstack([blobs([0.0, 3.0], per_blob=4), np.full((1, 8), 2.2)])
    found = cluster_descriptors(descriptors, eps=1.0)
    assert found.noise == 1 and found.count == 2
    assert found.labels[-1] == found.labels[4] != found.labels[0]


def test_a_clustering_that_finds_no_cluster_is_refused_in_one_line():
    with pytest.raises(FedcondError, match=r"found no cluster: .* raise descriptor-eps") as error:
        cluster_descriptors(blobs([0.0, 3.0], per_blob=3), eps=1e-6)
    assert "\n" not in str(error.value)


def test_what_the_server_found_survives_a_checkpoint():
    found = cluster_descriptors(blobs([0.0, 3.0], per_blob=3))
    back = DescriptorClusters.from_json(json.loads(json.dumps(found.as_json())))
    assert back.labels == found.labels and back.eps == found.eps
    np.testing.assert_array_equal(back.centroids, found.centroids)
    assert back.assign(np.full(8, 3.0)) == found.assign(np.full(8, 3.0))


def run(tmp_path, method: str, **settings) -> tuple[list[dict[str, str]], dict]:
    from fedcond.federation.methods import run_config
    from fedcond.tools.flwr_commands import default_config
    from fedcond.tools.in_process import run_in_process

    config = run_config({
        **default_config(), "method": method, "num-clusters": 3, "clients-per-cluster": 3, "held-out-clients": 1,
        "num-server-rounds": 3, "local-epochs": 1, "results-dir": str(tmp_path / method), "verbose": False,
        **settings,
    })  # fmt: skip
    recorder, _ = run_in_process(config)
    with (recorder.folder / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return rows, json.loads((recorder.folder / "run.json").read_text())


def test_with_descriptors_that_recover_the_true_clusters_it_is_oracle_round_for_round(tmp_path):
    """Digits E1 K=3: the class means separate the clusters (ARI 1), so each cluster trains its own model
    from the same start as Oracle's, and each newcomer is placed in its own cluster: Oracle's numbers."""
    ours, info = run(tmp_path, "descriptor-clustering", fingerprint="class-mean")
    oracle, _ = run(tmp_path, "oracle")
    (found,) = info["descriptor-clustering"]
    assert found["clusters"] == 3 and found["ari"] == 1.0 and found["sizes"] == [3, 3, 3]
    columns = ("accuracy", "heldout_accuracy", "accuracy_cluster_0", "accuracy_cluster_2", "bytes_down")
    assert [[row[c] for c in columns] for row in ours] == [[row[c] for c in columns] for row in oracle]
    assert all(float(row["ari"]) == 1.0 for row in ours)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fingerprint": "random-id"}, "fingerprint random-id describes none"),
        ({"fingerprint": "eigen-x", "scenario": "concept-permutation"}, "reads no labels"),
        ({"fingerprint-epsilon": 1.0}, "sends its descriptor unnoised: set fingerprint-epsilon=0"),
        ({"secure-aggregation": "secaggplus"}, "must see in the clear"),
    ],
)
def test_what_descriptor_clustering_cannot_honour_is_refused_before_anything_starts(settings, message):
    from fedcond.federation.checks import check_run
    from fedcond.federation.methods import run_config

    with pytest.raises(FedcondError, match=message) as error:
        check_run(run_config({"method": "descriptor-clustering", "num-clusters": 2, **settings}), load_data=False)
    assert "\n" not in str(error.value)
