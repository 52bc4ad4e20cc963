"""Client fingerprints: the paper's top eigenvalues of Cov(Z), Z = [phi(x) || onehot(y)], and others.

``FINGERPRINTS`` maps each ``fingerprint`` setting to its spec: ``eigen`` (the paper's),
``eigen-x`` (the same on phi(x) alone, for clients without labels), ``eigenvector`` (the
appendix's: the top eigenvectors themselves, not their eigenvalues), label-aware statistics that
see label permutations and rotations (``class-mean``, ``label-cov``; ``class-eigen`` sees
permutations only), and two controls (``random-id``: a pure client identifier; ``cluster-id``: the
true cluster). docs/fingerprints.md says what each reveals.

Computed by each client on its own training data, once, and kept on the client. Normalisation is
either local (``log``) or federated (``federated``: a z-score whose mean and standard deviation
come from a secure sum, see ``fedcond.fingerprint.statistics_encoding``); the raw vector never leaves the client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedcond.errors import FedcondError

# Below this many rows or columns a full SVD is cheaper than Lanczos iterations (and needs no k < rank).
EXACT_SVD_LIMIT = 128
LOG_FLOOR = 1e-4
# An eigenvector entry below this is zero for the choice of its sign.
SIGN_TOLERANCE = 1e-9
STD_FLOOR = 1e-8


def feature_matrix(images: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Z = [phi(x) || onehot(y)]; ``images`` are pixels in [0, 1] (flattened here) or embeddings. A
    regression task's real-valued targets enter as they are: Z = [phi(x) || y]."""
    pixels = images.reshape(len(images), -1).astype(np.float64)
    if np.issubdtype(labels.dtype, np.floating):
        return np.concatenate([pixels, labels.astype(np.float64)[:, None]], axis=1)
    onehot = np.zeros((len(labels), num_classes), dtype=np.float64)
    onehot[np.arange(len(labels)), labels] = 1.0
    return np.concatenate([pixels, onehot], axis=1)


def _top_singular(
    features: np.ndarray, count: int, seed: int, with_vectors: bool
) -> tuple[np.ndarray, np.ndarray | None, int]:
    """The top singular values of the centred ``features`` (descending), their right singular vectors
    as rows in the same order when ``with_vectors`` (else None), and how many there are: at most
    ``count``, and one fewer than the samples (centring removes one rank).

    A truncated (Lanczos, ARPACK) SVD costs O(n·d) per iteration and never forms the d x d
    covariance; below ``EXACT_SVD_LIMIT`` rows or columns the full SVD is used.
    """
    num_samples, num_features = features.shape
    if num_samples < 2:
        raise FedcondError(f"a fingerprint needs at least 2 training samples, the client holds {num_samples}")
    centred = features - features.mean(axis=0, keepdims=True)
    components = min(count, num_samples - 1, num_features)
    if min(num_samples, num_features) <= EXACT_SVD_LIMIT:
        if not with_vectors:
            return np.linalg.svd(centred, compute_uv=False)[:components], None, components
        _, singular, right = np.linalg.svd(centred, full_matrices=False)
        return singular[:components], right[:components], components
    # Imported here: scipy.sparse.linalg costs ~0.2 s, and a deployed ClientApp is a new process per
    # message that computes its fingerprint once (then keeps it in its state).
    from scipy.sparse.linalg import svds

    start = np.random.default_rng(seed).standard_normal(min(num_samples, num_features))
    if not with_vectors:
        singular = svds(centred, k=components, v0=start, return_singular_vectors=False, tol=0)
        return np.sort(singular)[::-1], None, components
    _, singular, right = svds(centred, k=components, v0=start, tol=0)
    order = np.argsort(singular)[::-1]  # svds returns them ascending
    return singular[order], right[order], components


def covariance_eigenvalues(features: np.ndarray, dim: int, seed: int = 0) -> np.ndarray:
    """Top-``dim`` eigenvalues of the sample covariance of ``features``, descending, zero-padded.

    From the SVD of the centred matrix (``_top_singular``): the same values as ``numpy.linalg.eigh``
    of the covariance to ~1e-10 relative, also where a randomized SVD would not (flat spectral
    tails). The result does not depend on the order of the rows.
    """
    singular, _, components = _top_singular(features, dim, seed, with_vectors=False)
    eigenvalues = np.zeros(dim, dtype=np.float64)
    eigenvalues[:components] = singular**2 / (len(features) - 1)
    return eigenvalues


def eigen_fingerprint(
    images: np.ndarray, labels: np.ndarray, num_classes: int, dim: int = 32, seed: int = 0
) -> np.ndarray:
    """The paper's fingerprint of one client's training data."""
    return covariance_eigenvalues(feature_matrix(images, labels, num_classes), dim, seed)


def covariance_eigenvectors(features: np.ndarray, count: int, seed: int = 0) -> np.ndarray:
    """The top-``count`` eigenvectors of the sample covariance of ``features``, as rows, largest
    eigenvalue first, zero rows where the rank runs out; flattened to ``count`` x features values.

    An eigenvector is defined up to its sign: each is turned so that its last entry (the last label
    column of Z) is positive, or where that is zero its largest entry, so that two clients of one
    distribution get the same vector and not its negative.
    """
    _, vectors, _ = _top_singular(features, count, seed, with_vectors=True)
    rows = np.zeros((count, features.shape[1]), dtype=np.float64)
    for index, vector in enumerate(vectors):
        pivot = vector[-1] if abs(vector[-1]) > SIGN_TOLERANCE else vector[np.argmax(np.abs(vector))]
        rows[index] = vector if pivot >= 0 else -vector
    return rows.ravel()


def eigenvector_fingerprint(
    features: np.ndarray, labels: np.ndarray, num_classes: int, count: int = 1, seed: int = 0
) -> np.ndarray:
    """The appendix's statistic: the first ``count`` eigenvectors of Cov(Z), Z = [phi(x) || onehot(y)].

    With the labels in Z: where the clusters differ only in their concept (the same x, labelled by
    another weight vector: ``concept-weights``), Cov(x) alone is the same for every cluster, and only
    the cross-covariance Cov(x, y), which points along the concept's weight vector, tells them apart.
    """
    return covariance_eigenvectors(feature_matrix(features, labels, num_classes), count, seed)


def label_free_fingerprint(images: np.ndarray, dim: int = 32, seed: int = 0) -> np.ndarray:
    """The top eigenvalues of Cov(phi(x)) alone: what a client without labels (a newcomer with
    unlabelled data) can compute. It sees how the images are distributed (which classes a client
    holds change that, and so do domains and subclasses), never which label an image carries: a
    label permutation (E3b) leaves it exactly unchanged, as it leaves the images unchanged."""
    return covariance_eigenvalues(images.reshape(len(images), -1).astype(np.float64), dim, seed)


def log_scale(fingerprint: np.ndarray) -> np.ndarray:
    """Local normalisation: eigenvalues span orders of magnitude, their logs do not."""
    return np.log10(np.maximum(fingerprint, 0.0) + LOG_FLOOR) / -np.log10(LOG_FLOOR)


def standardise(fingerprint: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Federated normalisation: z-score with the federation's mean and standard deviation."""
    return (fingerprint - mean) / np.maximum(std, STD_FLOOR)


def normalise(raw: np.ndarray, normalisation: str, mean: np.ndarray | None, std: np.ndarray | None) -> np.ndarray:
    """The fingerprint as the model is fed it: raw (``none``), ``log``-scaled, or z-scored (``federated``)
    with the federation's ``mean`` and ``std``."""
    if normalisation == "log":
        return log_scale(raw)
    if normalisation == "federated":
        if mean is None or std is None:
            raise FedcondError(
                "federated normalisation needs the federation's mean and std; the setup step did not run"
            )
        return standardise(raw, mean, std)
    return raw


def mean_and_std(
    total: np.ndarray, total_of_squares: np.ndarray, count: float, variance_floor: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension mean and population standard deviation from the two sums and the count; the
    variance at least ``variance_floor`` (sums noised by client-level DP: the noise's own std on the
    variance, below which an estimate is noise and a z-score by it would blow the fingerprint up)."""
    if count < 1:
        raise FedcondError("federated normalisation received no client statistics; check that clients answered")
    mean = total / count
    variance = np.maximum(total_of_squares / count - mean**2, variance_floor)
    return mean, np.sqrt(variance)


# -- pluggable fingerprints ------------------------------------------------------------------------
# Every fingerprint is computed by a client on its own training data and stays on the client.
#: The public seed of the random projection behind the sketches: the same matrix on every client.
PUBLIC_PROJECTION_SEED = 20_240_917


def per_class_width(dim: int, num_classes: int) -> int:
    """How many values a per-class fingerprint keeps for each class (at least one)."""
    return max(1, dim // num_classes)


def public_projection(num_features: int, width: int) -> np.ndarray:
    """A fixed (num_features, width) Gaussian matrix from a public seed, scaled to keep norms.

    It depends only on the public seed and the shapes, never on a client or the run's seed, so every
    client projects onto the same directions and their sketches are comparable.
    """
    rng = np.random.default_rng([PUBLIC_PROJECTION_SEED, num_features, width])
    return rng.standard_normal((num_features, width)) / np.sqrt(num_features)


def class_mean_sketch(images: np.ndarray, labels: np.ndarray, num_classes: int, dim: int) -> np.ndarray:
    """Per class, the mean image projected on the public projection, in label order.

    A class the client does not hold gives zeros. Label-ordered, so permuting labels permutes the
    blocks; pixel order matters through the projection, so rotating images changes it.
    """
    pixels = images.reshape(len(images), -1).astype(np.float64)
    width = per_class_width(dim, num_classes)
    projected = pixels @ public_projection(pixels.shape[1], width)
    sketch = np.zeros((num_classes, width))
    for label in range(num_classes):
        members = labels == label
        if members.any():
            sketch[label] = projected[members].mean(axis=0)
    return sketch.ravel()


def label_covariance_sketch(images: np.ndarray, labels: np.ndarray, num_classes: int, dim: int) -> np.ndarray:
    """The pixel-label cross-covariance block of Cov(Z), projected: Cov(P^T x, onehot(y)).

    Column c is p_c (mean_c - mean) on the projection: the off-diagonal block of the paper's
    covariance that its eigenvalues discard, sketched. It also carries the class frequencies p_c.
    """
    pixels = images.reshape(len(images), -1).astype(np.float64)
    width = per_class_width(dim, num_classes)
    projected = pixels @ public_projection(pixels.shape[1], width)
    projected -= projected.mean(axis=0, keepdims=True)
    onehot = np.zeros((len(labels), num_classes))
    onehot[np.arange(len(labels)), labels] = 1.0
    onehot -= onehot.mean(axis=0, keepdims=True)
    cross = onehot.T @ projected / max(len(labels) - 1, 1)  # (classes, width)
    return cross.ravel()


def class_eigen(images: np.ndarray, labels: np.ndarray, num_classes: int, dim: int, seed: int = 0) -> np.ndarray:
    """Per class, the top eigenvalues of the covariance of that class's images, in label order.

    Label-aware (permuting labels permutes the blocks) but, like ``eigen``, blind to any orthogonal
    change of pixel basis: a rotation by a multiple of 90 degrees leaves it unchanged.
    """
    pixels = images.reshape(len(images), -1)
    width = per_class_width(dim, num_classes)
    blocks = np.zeros((num_classes, width))
    for label in range(num_classes):
        members = pixels[labels == label]
        if len(members) >= 2:
            blocks[label] = covariance_eigenvalues(members.astype(np.float64), width, seed)
    return blocks.ravel()


def random_id(dim: int, seed: int, partition_id: int) -> np.ndarray:
    """A standard normal vector drawn per client: it describes nothing but which client this is."""
    return np.random.default_rng([seed, partition_id, 7]).standard_normal(dim)


def cluster_one_hot(cluster: int, num_clusters: int) -> np.ndarray:
    """The true cluster, one-hot: a reference for what a perfect description could give."""
    vector = np.zeros(num_clusters)
    vector[cluster] = 1.0
    return vector


@dataclass(frozen=True)
class ClientSample:
    """What a client computes its fingerprint from: its own training data and who it is.

    ``features`` are phi(x) (pixels in [0, 1] or the frozen encoder's embedding) for fingerprints that
    need data; ``partition_id`` and ``cluster`` serve only the two controls.
    """

    features: np.ndarray
    labels: np.ndarray
    num_classes: int
    dim: int
    seed: int = 0
    partition_id: int = 0
    cluster: int = 0
    num_clusters: int = 1


@dataclass(frozen=True)
class FingerprintSpec:
    """One fingerprint: how it is computed, how long it is, and what it needs and is."""

    compute: Callable[[ClientSample], np.ndarray]
    #: (dim, num_classes, num_clusters, features of phi(x)) -> length: the conditioned model's input size.
    size: Callable[[int, int, int, int], int]
    #: False for the controls, which read no sample (so no encoder need embed anything for them).
    needs_data: bool = True
    #: Entries are variances (non-negative, spanning decades): ``log`` scaling fits them.
    spectral: bool = False
    #: Whether it reads the labels: one that does not (``eigen-x``) serves clients without labels, and
    #: cannot tell apart clusters that differ only in their labels (``ScenarioKind.labels_only``).
    reads_labels: bool = True
    #: It summarises each class apart: a regression task, whose targets are real numbers, has none.
    per_class: bool = False


def _per_class_size(dim: int, num_classes: int, _num_clusters: int, _features: int) -> int:
    return num_classes * per_class_width(dim, num_classes)


# The one table of fingerprints; docs/fingerprints.md says what each reveals.
FINGERPRINTS: dict[str, FingerprintSpec] = {
    "eigen": FingerprintSpec(
        lambda s: eigen_fingerprint(s.features, s.labels, s.num_classes, s.dim, s.seed),
        lambda dim, _classes, _clusters, _features: dim,
        spectral=True,
    ),
    "eigen-x": FingerprintSpec(
        lambda s: label_free_fingerprint(s.features, s.dim, s.seed),
        lambda dim, _classes, _clusters, _features: dim,
        spectral=True,
        reads_labels=False,
    ),
    "class-mean": FingerprintSpec(
        lambda s: class_mean_sketch(s.features, s.labels, s.num_classes, s.dim), _per_class_size, per_class=True
    ),
    "label-cov": FingerprintSpec(
        lambda s: label_covariance_sketch(s.features, s.labels, s.num_classes, s.dim), _per_class_size, per_class=True
    ),
    "class-eigen": FingerprintSpec(
        lambda s: class_eigen(s.features, s.labels, s.num_classes, s.dim, s.seed),
        _per_class_size,
        spectral=True,
        per_class=True,
    ),
    "eigenvector": FingerprintSpec(
        lambda s: eigenvector_fingerprint(s.features, s.labels, s.num_classes, s.dim, s.seed),
        lambda dim, classes, _clusters, features: dim * (features + classes),
    ),
    "random-id": FingerprintSpec(
        lambda s: random_id(s.dim, s.seed, s.partition_id),
        lambda dim, _classes, _clusters, _features: dim,
        needs_data=False,
    ),
    "cluster-id": FingerprintSpec(
        lambda s: cluster_one_hot(s.cluster, s.num_clusters),
        lambda _dim, _classes, clusters, _features: clusters,
        needs_data=False,
    ),
}


def fingerprint_spec(name: str) -> FingerprintSpec:
    if name not in FINGERPRINTS:
        raise FedcondError(f"unknown fingerprint '{name}'; choose one of {', '.join(FINGERPRINTS)}")
    return FINGERPRINTS[name]


def check_fingerprint(name: str, normalisation: str) -> None:
    """A known fingerprint under a normalisation that makes sense for it."""
    spec = fingerprint_spec(name)
    if normalisation == "log" and not spec.spectral:
        spectral = ", ".join(key for key, spec in FINGERPRINTS.items() if spec.spectral)
        raise FedcondError(
            f"normalisation=log takes logarithms of eigenvalues ({spectral}); "
            f"fingerprint {name} has signed entries: use normalisation=federated or none"
        )


def check_label_free(name: str, scenario: str) -> None:
    """Fingerprint ``name`` asked to tell apart ``scenario``'s clusters, which differ only in their
    labels (``fedcond.data.scenarios.ScenarioKind.labels_only``): refused if it reads no labels."""
    spec = fingerprint_spec(name)
    if spec.needs_data and not spec.reads_labels:
        raise FedcondError(
            f"fingerprint {name} reads no labels, and {scenario}'s clusters differ only in their labels (the "
            "images are the same): it cannot tell them apart; use a label-aware fingerprint (class-mean, "
            "label-cov, class-eigen)"
        )


def phi_features(dataset: str, encoder: str) -> int:
    """How many values phi(x) has per sample of ``dataset``: the frozen ``encoder``'s embedding, else
    the pixels (or a tabular task's features)."""
    from fedcond.data.datasets import dataset_spec

    if encoder != "pixels":
        from fedcond.fingerprint.encoder import EMBEDDING_DIM

        return EMBEDDING_DIM
    return int(np.prod(dataset_spec(dataset).input_shape))


def check_fingerprint_for(name: str, dim: int, dataset: str, encoder: str, normalisation: str = "none") -> None:
    """Fingerprint ``name`` on ``dataset``: a per-class one needs classes, and ``eigenvector`` keeps
    fingerprint-dim eigenvectors of Cov(Z), no more than Z has dimensions, and is not z-scored on images.

    Each eigenvector is unit-norm already, and on images most of its entries are pixels that barely
    differ between clients: the federated z-score blows every one of them up to unit spread, so the
    fingerprint's squared norm becomes its length (25,408 for 32 eigenvectors on MNIST) and the
    first layer's step that many times a plain input's. Refused there (MNIST E3b K=2, 10% data:
    training loss 1.2e5 in round 1, 8e11 in round 2, then chance every round); the appendix's
    tabular tasks (l x 11 values) keep the choice."""
    from fedcond.data.datasets import dataset_spec

    if fingerprint_spec(name).per_class and dataset_spec(dataset).regression:
        whole = ", ".join(key for key, spec in FINGERPRINTS.items() if spec.needs_data and not spec.per_class)
        raise FedcondError(
            f"fingerprint {name} summarises each class, and {dataset} is a regression task (real-valued targets); "
            f"choose one of {whole}"
        )
    if name != "eigenvector":
        return
    spec = dataset_spec(dataset)
    dimensions = phi_features(dataset, encoder) + spec.num_classes
    if normalisation == "federated" and not spec.tabular:
        raise FedcondError(
            f"fingerprint eigenvector z-scored (normalisation=federated) on {dataset} makes each of its "
            f"{dim * dimensions} values unit-spread, most of them pixels no client differs in, and training diverges; "
            "set normalisation=none (each eigenvector is unit-norm already, as the EMNIST appendix grid runs it)"
        )
    if dim > dimensions:
        raise FedcondError(
            f"fingerprint eigenvector keeps fingerprint-dim eigenvectors of the {dimensions}-dimensional Z of "
            f"{dataset}; set fingerprint-dim to 1..{dimensions} (the appendix's: 1), not {dim}"
        )


def fingerprint_size(name: str, dim: int, num_classes: int, num_clusters: int, num_features: int) -> int:
    """The length of fingerprint ``name`` (``num_features``: of phi(x)): the conditioned model's input size."""
    return fingerprint_spec(name).size(dim, num_classes, num_clusters, num_features)


def compute_fingerprint(name: str, sample: ClientSample) -> np.ndarray:
    """Fingerprint ``name`` of one client's training data."""
    return fingerprint_spec(name).compute(sample)
