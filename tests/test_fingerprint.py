import numpy as np
import pytest

from fedcond.errors import FedcondError
from fedcond.fingerprint import fingerprints as fp


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


# -- pluggable fingerprints: what they are blind to --------------------------------------------------
@pytest.fixture(scope="module")
def digit_sample():
    from fedcond.data.datasets import load_dataset

    digits = load_dataset("digits")
    return digits.train_x[:400], digits.train_y[:400]


def _changes(name, images, labels):
    """Relative change of fingerprint ``name`` under a label derangement, rot90 and rot180."""
    from fedcond.data.client_data import rotate_images

    def compute(x, y):
        return fp.compute_fingerprint(name, fp.ClientSample(x, y, num_classes=10, dim=32))

    base = compute(images, labels)
    permutation = np.roll(np.arange(10), 1)  # every label moves
    changed = [
        compute(images, permutation[labels]),
        compute(rotate_images(images, 90), labels),
        compute(rotate_images(images, 180), labels),
    ]
    return [np.linalg.norm(other - base) / np.linalg.norm(base) for other in changed]


def test_eigen_is_blind_to_label_permutation_and_right_angle_rotation(digit_sample):
    # Both are orthogonal changes of basis of Z = [x || onehot(y)]: the spectrum cannot see them.
    assert max(_changes("eigen", *digit_sample)) < 1e-10


@pytest.mark.parametrize("name", ["class-mean", "label-cov"])
def test_label_aware_sketches_see_label_permutation_and_rotation(digit_sample, name):
    assert min(_changes(name, *digit_sample)) > 0.1


def test_class_eigen_sees_label_permutation_but_not_right_angle_rotation(digit_sample):
    permuted, rot90, rot180 = _changes("class-eigen", *digit_sample)
    assert permuted > 0.05 and max(rot90, rot180) < 1e-10


def test_the_label_free_fingerprint_reads_no_label_and_sees_which_classes_a_client_holds(digit_sample):
    images, labels = digit_sample
    assert max(_changes("eigen-x", images, labels)) < 1e-10  # blind to permutations (and right angles)
    np.testing.assert_allclose(
        fp.compute_fingerprint("eigen-x", fp.ClientSample(images, np.zeros_like(labels), 10, 32)),
        fp.covariance_eigenvalues(images.reshape(len(images), -1).astype(np.float64), 32),
    )  # the labels given do not matter at all
    low, high = labels < 5, labels >= 5  # two label-shift clusters: different images, different spectra
    first, second = (
        fp.compute_fingerprint("eigen-x", fp.ClientSample(images[m], labels[m], 10, 32)) for m in (low, high)
    )
    assert np.linalg.norm(first - second) / np.linalg.norm(first) > 0.05


def test_a_label_free_fingerprint_asked_to_see_a_label_permutation_is_refused_in_one_line():
    from fedcond.federation.checks import check_run
    from fedcond.federation.methods import run_config

    with pytest.raises(FedcondError, match="eigen-x reads no labels, and concept-permutation's clusters differ only"):
        check_run(run_config({"fingerprint": "eigen-x", "scenario": "concept-permutation", "num-clusters": 2}))
    check_run(run_config({"fingerprint": "eigen-x", "scenario": "label-shift"}))
    check_run(run_config({"method": "fedavg", "fingerprint": "eigen-x", "scenario": "concept-permutation",
                          "num-clusters": 2}))  # fmt: skip  # a method that reads no fingerprint: nothing to see


def test_fingerprint_sizes_and_controls():
    assert fp.fingerprint_size("eigen", 32, 10, 2, 784) == 32 == fp.fingerprint_size("random-id", 32, 10, 2, 784)
    assert fp.fingerprint_size("class-mean", 32, 10, 2, 784) == 30 == fp.fingerprint_size("class-eigen", 32, 10, 2, 784)
    assert fp.fingerprint_size("cluster-id", 32, 10, 4, 784) == 4
    assert fp.fingerprint_size("eigenvector", 2, 10, 4, 784) == 2 * 794  # two eigenvectors of Z = [x || onehot(y)]
    images, labels = np.zeros((4, 1, 4, 4)), np.array([0, 1, 0, 1])
    ids = [
        fp.compute_fingerprint("random-id", fp.ClientSample(images, labels, 2, 8, partition_id=client, num_clusters=2))
        for client in (0, 0, 1)
    ]
    np.testing.assert_array_equal(ids[0], ids[1])
    assert ids[0].shape == (8,) and not np.allclose(ids[0], ids[2])
    one_hot = fp.compute_fingerprint("cluster-id", fp.ClientSample(images, labels, 2, 8, cluster=3, num_clusters=4))
    np.testing.assert_array_equal(one_hot, [0, 0, 0, 1])


def test_sketch_projection_is_public_and_a_missing_class_gives_zeros():
    np.testing.assert_array_equal(fp.public_projection(64, 3), fp.public_projection(64, 3))
    rng = np.random.default_rng(5)
    images, labels = rng.random((20, 1, 8, 8)), np.array([0, 1] * 10)
    # The run's seed does not enter the sketch: clients of different runs are comparable.
    first = fp.compute_fingerprint("class-mean", fp.ClientSample(images, labels, 3, 6))
    np.testing.assert_array_equal(
        first, fp.compute_fingerprint("class-mean", fp.ClientSample(images, labels, 3, 6, seed=99, partition_id=4))
    )
    assert first.shape == (6,) and np.all(first[4:] == 0) and np.all(first[:4] != 0)  # class 2 absent


def test_log_normalisation_is_only_for_spectra():
    fp.check_fingerprint("class-eigen", "log")
    with pytest.raises(FedcondError, match="normalisation=log"):
        fp.check_fingerprint("random-id", "log")
    with pytest.raises(FedcondError, match="unknown fingerprint"):
        fp.check_fingerprint("nope", "none")


def test_the_fingerprint_table_describes_each_fingerprint():
    # The controls read no sample: computed from empty features they still have their size.
    empty = fp.ClientSample(np.zeros((0, 4)), np.zeros(0, dtype=int), num_classes=10, dim=32, num_clusters=3)
    for name, spec in fp.FINGERPRINTS.items():
        if not spec.needs_data:
            assert len(spec.compute(empty)) == spec.size(32, 10, 3, 4), name
    assert {name for name, spec in fp.FINGERPRINTS.items() if spec.spectral} == {"eigen", "eigen-x", "class-eigen"}
    assert {name for name, spec in fp.FINGERPRINTS.items() if spec.needs_data and not spec.reads_labels} == {"eigen-x"}
