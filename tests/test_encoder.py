import numpy as np
import pytest

from fedcond.config import RunConfig
from fedcond.data.cifar import cache_dir
from fedcond.data.scenarios import validate_without_data
from fedcond.errors import FedcondError
from fedcond.fingerprint import encoder


def test_grey_28px_images_become_rgb_32px():
    rgb = encoder.as_rgb32(np.ones((2, 1, 28, 28), dtype=np.float32))
    assert rgb.shape == (2, 3, 32, 32) and rgb[0, :, 0, 0].sum() == 0 and rgb[0, :, 2, 2].tolist() == [1, 1, 1]


@pytest.mark.slow
def test_encoder_is_trained_once_cached_and_embeds_128d(tmp_path, monkeypatch):
    from tests.test_datasets import write_fake_mnist

    write_fake_mnist(tmp_path / "fashion-mnist", train=40, test=10)
    monkeypatch.setitem(encoder.ENCODER_SETTINGS, "samples", 32)
    monkeypatch.setitem(encoder.ENCODER_SETTINGS, "epochs", 1)
    encoder.load_encoder.cache_clear()
    vectors = encoder.embed(np.random.default_rng(0).random((5, 3, 32, 32)), "fashion-mnist", tmp_path)
    assert vectors.shape == (5, 128) and np.all(np.isfinite(vectors))
    (cached,) = cache_dir().glob("encoder-fashion-mnist-*.pt")
    encoder.load_encoder.cache_clear()
    monkeypatch.setattr(encoder, "train_encoder", lambda *args: pytest.fail("trained again despite the cache"))
    again = encoder.embed(np.random.default_rng(0).random((5, 3, 32, 32)), "fashion-mnist", tmp_path)
    np.testing.assert_allclose(again, vectors, rtol=1e-5)
    assert cached.is_file()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dataset": "cifar10", "fingerprint_encoder": "cifar10"}, "clients' own dataset"),
        ({"dataset": "mnist", "scenario": "domain", "num_clusters": 2, "fingerprint_encoder": "fashion-mnist"}, "own"),
        ({"dataset": "cifar10", "fingerprint_encoder": "imagenet"}, "unknown fingerprint-encoder"),
    ],
)
def test_encoder_must_come_from_data_no_client_holds(settings, message):
    with pytest.raises(FedcondError, match=message):
        validate_without_data(RunConfig(**settings))


def test_a_reserved_part_of_the_clients_own_dataset_is_allowed_and_named_in_the_refusal():
    validate_without_data(RunConfig(dataset="cifar10", fingerprint_encoder="cifar10-reserved"))
    with pytest.raises(FedcondError, match="or cifar10-reserved"):
        validate_without_data(RunConfig(dataset="cifar10", fingerprint_encoder="cifar10"))
    with pytest.raises(FedcondError, match="unknown fingerprint-encoder 'imagenet-reserved'"):
        validate_without_data(RunConfig(dataset="cifar10", fingerprint_encoder="imagenet-reserved"))


def test_the_encoder_choice_scores_tell_separated_clusters_from_mixed_ones():
    """experiments/encoder_choice.py: clusters far apart score 1 on every measure; fingerprints that
    carry no cluster (noise) score about chance."""
    from tests.scripts import load_script

    scores = load_script("experiments/encoder_choice.py").scores
    rng = np.random.default_rng(0)
    clusters = np.repeat(np.arange(4), 10)
    concepts = clusters // 2
    centres = rng.normal(size=(4, 32)) * 10
    separated = scores(centres[clusters] + rng.normal(size=(40, 32)), clusters, concepts)
    assert separated["1-NN cluster"] == separated["1-NN concept"] == 1.0 and separated["k-means ARI"] == 1.0
    assert separated["between / within"] > 3
    noise = scores(rng.normal(size=(40, 32)), clusters, concepts)
    assert noise["1-NN cluster"] < 0.5 and noise["k-means ARI"] < 0.2 and noise["between / within"] < 1.1
