import numpy as np
import pytest

from fedcond.errors import FedcondError
from fedcond.models import build_model, get_weights
from fedcond.training import TrainSettings, evaluate, train


def toy_data(n=64):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=n)
    images = rng.random((n, 1, 8, 8)).astype(np.float32) * 0.2
    images[labels == 1, :, :4, :] += 0.8  # class 1: bright top half
    return images, labels


def test_local_training_learns_and_is_reproducible():
    images, labels = toy_data()
    settings = TrainSettings(epochs=15, batch_size=16, learning_rate=0.05, momentum=0.9)
    first, second = build_model((1, 8, 8), 2, 0, seed=0), build_model((1, 8, 8), 2, 0, seed=0)
    before = evaluate(first, images, labels, None)
    train(first, images, labels, None, settings, seed=7)
    train(second, images, labels, None, settings, seed=7)
    after = evaluate(first, images, labels, None)
    assert after.loss < before.loss and after.accuracy > 0.9
    for a, b in zip(get_weights(first), get_weights(second), strict=True):
        np.testing.assert_array_equal(a, b)


def test_nan_loss_stops_with_the_fix():
    images, labels = toy_data()
    model = build_model((1, 8, 8), 2, 0, seed=0)
    with pytest.raises(FedcondError, match="lower learning-rate"):
        train(model, images * 1e30, labels, None, TrainSettings(3, 16, 1e6, 0.9), seed=0)
