"""The client fingerprint: top eigenvalues of the covariance of Z = [phi(x) || onehot(y)].

Computed by each client on its own training data, once, and kept on the client. Normalisation is
either local (``log``) or federated (``federated``: a z-score whose mean and standard deviation
come from a secure sum, see ``fedcond.secure_sum``); the raw vector never leaves the client.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse.linalg import svds

from fedcond.errors import FedcondError

# Below this many rows or columns a full SVD is cheaper than Lanczos iterations (and needs no k < rank).
EXACT_SVD_LIMIT = 128
LOG_FLOOR = 1e-4
STD_FLOOR = 1e-8


def feature_matrix(images: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Z = [phi(x) || onehot(y)]; ``images`` are pixels in [0, 1] (flattened here) or embeddings."""
    pixels = images.reshape(len(images), -1).astype(np.float64)
    onehot = np.zeros((len(labels), num_classes), dtype=np.float64)
    onehot[np.arange(len(labels)), labels] = 1.0
    return np.concatenate([pixels, onehot], axis=1)


def covariance_eigenvalues(features: np.ndarray, dim: int, seed: int = 0) -> np.ndarray:
    """Top-``dim`` eigenvalues of the sample covariance of ``features``, descending, zero-padded.

    A truncated (Lanczos, ARPACK) SVD of the centred matrix costs O(n·d) per iteration and never
    forms the d x d covariance; it converges to the same values as ``numpy.linalg.eigh`` of the
    covariance to ~1e-10 relative, also where a randomized SVD would not (flat spectral tails). The
    result does not depend on the order of the rows.
    """
    num_samples, num_features = features.shape
    if num_samples < 2:
        raise FedcondError(f"a fingerprint needs at least 2 training samples, the client holds {num_samples}")
    centred = features - features.mean(axis=0, keepdims=True)
    components = min(dim, num_samples - 1, num_features)  # centring removes one rank
    if min(num_samples, num_features) <= EXACT_SVD_LIMIT:
        singular = np.linalg.svd(centred, compute_uv=False)[:components]
    else:
        start = np.random.default_rng(seed).standard_normal(min(num_samples, num_features))
        singular = svds(centred, k=components, v0=start, return_singular_vectors=False, tol=0)
    eigenvalues = np.zeros(dim, dtype=np.float64)
    eigenvalues[:components] = np.sort(singular**2 / (num_samples - 1))[::-1]
    return eigenvalues


def eigen_fingerprint(
    images: np.ndarray, labels: np.ndarray, num_classes: int, dim: int = 32, seed: int = 0
) -> np.ndarray:
    """The paper's fingerprint of one client's training data."""
    return covariance_eigenvalues(feature_matrix(images, labels, num_classes), dim, seed)


def log_scale(fingerprint: np.ndarray) -> np.ndarray:
    """Local normalisation: eigenvalues span orders of magnitude, their logs do not."""
    return np.log10(np.maximum(fingerprint, 0.0) + LOG_FLOOR) / -np.log10(LOG_FLOOR)


def standardise(fingerprint: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Federated normalisation: z-score with the federation's mean and standard deviation."""
    return (fingerprint - mean) / np.maximum(std, STD_FLOOR)


def mean_and_std(total: np.ndarray, total_of_squares: np.ndarray, count: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension mean and population standard deviation from the two sums and the count."""
    if count < 1:
        raise FedcondError("federated normalisation received no client statistics; check that clients answered")
    mean = total / count
    variance = np.maximum(total_of_squares / count - mean**2, 0.0)
    return mean, np.sqrt(variance)
