import numpy as np
import pytest

from fedcond import fingerprint as fp
from fedcond.errors import FedcondError


def reference_eigenvalues(features: np.ndarray, dim: int) -> np.ndarray:
    values = np.linalg.eigh(np.cov(features, rowvar=False))[0][::-1][:dim]
    return np.pad(np.clip(values, 0, None), (0, max(0, dim - len(values))))


@pytest.mark.parametrize(("num_samples", "side"), [(60, 8), (400, 14)])  # exact and randomized paths
def test_fingerprint_matches_eigh_of_covariance(num_samples, side):
    rng = np.random.default_rng(1)
    # Low-rank structure plus noise, like images: a decaying spectrum.
    basis = rng.normal(size=(5, side * side))
    images = rng.normal(size=(num_samples, 5)) @ basis + 0.1 * rng.normal(size=(num_samples, side * side))
    images = images.reshape(num_samples, 1, side, side)
    labels = rng.integers(0, 10, size=num_samples)
    expected = reference_eigenvalues(fp.feature_matrix(images, labels, 10), 32)
    result = fp.eigen_fingerprint(images, labels, num_classes=10, dim=32)
    np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-9 * expected[0])


def test_fingerprint_does_not_depend_on_sample_order():
    rng = np.random.default_rng(2)
    images = rng.random((300, 1, 12, 12))
    labels = rng.integers(0, 4, size=300)
    order = rng.permutation(300)
    first = fp.eigen_fingerprint(images, labels, 4, 16)
    second = fp.eigen_fingerprint(images[order], labels[order], 4, 16)
    np.testing.assert_allclose(first, second, rtol=1e-9)


def test_fingerprint_is_zero_padded_when_rank_is_small():
    rng = np.random.default_rng(3)
    images = rng.random((6, 1, 4, 4))
    labels = np.array([0, 1, 0, 1, 0, 1])
    result = fp.eigen_fingerprint(images, labels, 2, dim=32)
    assert result.shape == (32,)
    assert np.all(result[5:] == 0)  # 6 centred samples have rank <= 5
    assert np.all(result[:5] > 0)
    assert np.all(np.diff(result) <= 0)


def test_fingerprint_needs_two_samples():
    with pytest.raises(FedcondError, match="at least 2"):
        fp.eigen_fingerprint(np.zeros((1, 1, 4, 4)), np.array([0]), 2)


def test_federated_standardisation_matches_pooled_zscore():
    rng = np.random.default_rng(4)
    vectors = rng.random((7, 5)) * 10
    mean, std = fp.mean_and_std(vectors.sum(0), (vectors**2).sum(0), len(vectors))
    np.testing.assert_allclose(mean, vectors.mean(0))
    np.testing.assert_allclose(std, vectors.std(0))
    np.testing.assert_allclose(fp.standardise(vectors[0], mean, std), (vectors[0] - vectors.mean(0)) / vectors.std(0))
