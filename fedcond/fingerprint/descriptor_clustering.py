"""Clustering clients by a descriptor of their data, without being told how many clusters there are:
the server's side of descriptor clustering (in the style of FLUX, Fenoglio et al., NeurIPS 2025).

Each client sends a compact descriptor of its training data (here: its fingerprint, the very
statistics the paper's Conditional is fed, so that the comparison asks whether a continuous
condition beats clustering on the same numbers). The server standardises the training clients'
descriptors (each coordinate to mean 0, std 1 over them) and clusters them with scikit-learn's
DBSCAN, which finds the number of clusters itself. A client DBSCAN leaves as noise joins the
cluster with the nearest centroid (every client is served a cluster model, as in FLUX); a
newcomer, labelled or not (``fingerprint = "eigen-x"`` reads no labels), is assigned the same way.

DBSCAN's radius ``eps``, given or adaptive (``adaptive_eps``): with ``min_samples = 2`` DBSCAN
links two clients whenever they are within ``eps`` of each other, so its clusters are single
linkage's cut at ``eps``; the adaptive radius is the single-linkage cut (at one of the minimum
spanning tree's widest jumps in edge length) with the best silhouette, or one cluster when no cut
has a silhouette above ``NO_STRUCTURE``. FLUX's own
adaptive DBSCAN is not public in detail; this rule is ours, and ``descriptor-eps`` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedcond.errors import FedcondError

#: The adaptive radius: the silhouette a cut must beat (Kaufman and Rousseeuw 1990: 0.25 or less is "no
#: substantial structure"), and how many of the minimum spanning tree's widest jumps it tries.
NO_STRUCTURE = 0.25
CANDIDATE_CUTS = 10


@dataclass(frozen=True)
class DescriptorClusters:
    """What the server found: each training client's cluster and how to place any other client."""

    #: Training client (in the order given) -> its cluster, 0..K-1 (noise folded into the nearest).
    labels: tuple[int, ...]
    #: K x d, in the standardised space.
    centroids: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    #: The DBSCAN radius used (given or adaptive) and how many clients it left as noise.
    eps: float
    noise: int

    @property
    def count(self) -> int:
        return len(self.centroids)

    def assign(self, descriptor: np.ndarray) -> int:
        """The cluster whose centroid is nearest to ``descriptor`` (standardised as the training ones)."""
        return nearest(self.centroids, (np.asarray(descriptor, dtype=np.float64) - self.mean) / self.std)

    def as_json(self) -> dict[str, object]:
        return {
            "labels": list(self.labels), "centroids": self.centroids.tolist(), "mean": self.mean.tolist(),
            "std": self.std.tolist(), "eps": self.eps, "noise": self.noise,
        }  # fmt: skip

    @classmethod
    def from_json(cls, values: dict[str, object]) -> DescriptorClusters:
        return cls(
            tuple(int(label) for label in values["labels"]),  # type: ignore[attr-defined]
            np.asarray(values["centroids"], dtype=np.float64), np.asarray(values["mean"], dtype=np.float64),
            np.asarray(values["std"], dtype=np.float64), float(values["eps"]), int(values["noise"]),  # type: ignore[arg-type]
        )  # fmt: skip


def nearest(centroids: np.ndarray, point: np.ndarray) -> int:
    """The index of the centroid nearest to ``point`` (Euclidean, in the standardised space)."""
    return int(np.argmin(np.linalg.norm(centroids - point, axis=1)))


def standardised(descriptors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(points, mean, std): each coordinate to mean 0 and std 1 over the clients (a constant one: std 1)."""
    mean = descriptors.mean(axis=0)
    std = descriptors.std(axis=0)
    std = np.where(std > 1e-12, std, 1.0)
    return (descriptors - mean) / std, mean, std


def adaptive_eps(points: np.ndarray) -> float:
    """The radius of the best single-linkage cut: between two consecutive sorted edge lengths of the
    minimum spanning tree, at the ``CANDIDATE_CUTS`` widest jumps, the cut whose clusters have the
    highest mean silhouette. Below ``NO_STRUCTURE`` (Kaufman and Rousseeuw's "no substantial
    structure"), a radius above every edge: one cluster."""
    from scipy.sparse.csgraph import connected_components, minimum_spanning_tree
    from scipy.spatial.distance import pdist, squareform
    from sklearn.metrics import silhouette_score

    distances = squareform(pdist(points))
    tree = minimum_spanning_tree(distances).toarray()
    edges = np.sort(tree[np.nonzero(tree)])
    if len(edges) == 0:  # every client has the same descriptor
        return 1.0
    one_cluster = float(edges[-1] * 1.01)
    best, best_score = one_cluster, NO_STRUCTURE
    for cut in np.argsort(-np.diff(edges))[:CANDIDATE_CUTS]:
        radius = float(np.sqrt(max(edges[cut], 1e-12) * edges[cut + 1]))  # the jump's geometric middle
        _, labels = connected_components(np.where(tree < radius, tree, 0), directed=False)
        if 2 <= labels.max() + 1 < len(points):
            score = float(silhouette_score(distances, labels, metric="precomputed"))
            if score > best_score:
                best, best_score = radius, score
    return best


def cluster_descriptors(descriptors: np.ndarray, eps: float = 0.0, min_samples: int = 2) -> DescriptorClusters:
    """DBSCAN on the standardised descriptors (``eps = 0``: ``adaptive_eps``); noise folded into the
    nearest cluster. A clustering that finds no cluster at all is refused in one line."""
    from sklearn.cluster import DBSCAN

    descriptors = np.asarray(descriptors, dtype=np.float64)
    if len(descriptors) < 2:
        raise FedcondError("descriptor clustering needs 2 training clients or more")
    points, mean, std = standardised(descriptors)
    radius = eps if eps > 0 else adaptive_eps(points)
    found = DBSCAN(eps=radius, min_samples=min_samples).fit(points).labels_
    clusters = sorted(set(found.tolist()) - {-1})
    if not clusters:
        raise FedcondError(
            f"descriptor clustering found no cluster: DBSCAN left every one of the {len(points)} clients as noise "
            f"at descriptor-eps={radius:.3g} with descriptor-min-samples={min_samples}; raise descriptor-eps "
            "(0: the adaptive radius) or lower descriptor-min-samples"
        )
    centroids = np.stack([points[found == cluster].mean(axis=0) for cluster in clusters])
    labels = [
        clusters.index(label) if label != -1 else nearest(centroids, point)
        for label, point in zip(found.tolist(), points, strict=True)
    ]
    return DescriptorClusters(tuple(labels), centroids, mean, std, radius, int(np.sum(found == -1)))
