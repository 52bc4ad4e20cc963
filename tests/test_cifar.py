"""CIFAR loaders (image folders, torchvision's pickles), their scenarios and the CIFAR CNN, on tiny fakes."""

import pickle

import numpy as np
import pytest
import torch

from fedcond.config import RunConfig
from fedcond.data.cifar import CIFAR10_CLASSES, cache_dir
from fedcond.data.datasets import load_dataset
from fedcond.data.scenarios import build_scenario
from fedcond.errors import FedcondError
from fedcond.model.networks import build_model


def write_cifar10_folder(root, per_class=(6, 3), bands=False):
    """CIFAR-10's folder layout with made-up images: each class one grey level (``bands``: a bright
    horizontal band at the class's own height on a noisy image, which a CNN with batch norm learns in
    a few steps), small noise on every pixel."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in zip(("train", "test"), per_class, strict=True):
        for label, name in enumerate(CIFAR10_CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                if bands:
                    pixels = rng.integers(0, 60, (32, 32, 3), dtype=np.uint8)
                    pixels[3 * label : 3 * label + 3] = 255
                else:
                    pixels = np.full((32, 32, 3), 20 * label, dtype=np.uint8) + rng.integers(
                        0, 5, (32, 32, 3), dtype=np.uint8
                    )
                Image.fromarray(pixels).save(folder / f"{i:04d}.png")
    return root


def write_cifar100_pickles(root, per_class=(2, 1)):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    coarse_of = np.arange(100) // 5  # a made-up but complete fine -> coarse map
    for split, count in zip(("train", "test"), per_class, strict=True):
        fine = np.repeat(np.arange(100), count)
        data = rng.integers(0, 256, (len(fine), 3072), dtype=np.uint8)
        batch = {b"data": data, b"fine_labels": fine.tolist(), b"coarse_labels": coarse_of[fine].tolist()}
        (folder / split).write_bytes(pickle.dumps(batch))
    meta = {b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
            b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)]}  # fmt: skip
    (folder / "meta").write_bytes(pickle.dumps(meta))
    return root


def test_cifar10_image_folders_are_decoded_once_and_cached(tmp_path):
    root = write_cifar10_folder(tmp_path / "cifar10-jpeg")
    dataset = load_dataset("cifar10", tmp_path)
    assert dataset.train_x.shape == (60, 3, 32, 32) and dataset.test_x.shape == (30, 3, 32, 32)
    assert dataset.train_x.dtype == np.float32 and dataset.train_x.min() >= 0 and dataset.train_x.max() <= 1
    assert np.bincount(dataset.train_y).tolist() == [6] * 10
    assert dataset.superclass_names == ("vehicle", "animal") and dataset.superclass_of[0] == 0
    assert len(list(cache_dir().glob("cifar10-images-*.npz"))) == 1
    # The cache, not the images, serves the next process: remove one image and decode again.
    (root / "train" / "cat" / "0000.png").unlink()
    load_dataset.cache_clear()
    assert load_dataset("cifar10", tmp_path).train_x.shape == (60, 3, 32, 32)


def test_cifar100_pickles_give_fine_labels_and_superclasses(tmp_path):
    dataset = load_dataset("cifar100", write_cifar100_pickles(tmp_path))
    assert dataset.num_classes == 100 and len(dataset.superclass_names) == 20
    assert dataset.train_x.shape == (200, 3, 32, 32)
    assert dataset.superclass_of[:6] == (0, 0, 0, 0, 0, 1)


def test_corrupt_cifar100_file_is_reported(tmp_path):
    root = write_cifar100_pickles(tmp_path)
    train = root / "cifar-100-python" / "train"
    train.write_bytes(train.read_bytes()[:100])
    with pytest.raises(FedcondError, match="truncated or corrupt"):
        load_dataset("cifar100", root)


def test_missing_cifar_folder_names_the_fix(tmp_path):
    with pytest.raises(FedcondError, match="point data-dir"):
        load_dataset("cifar10", tmp_path)


@pytest.fixture
def cifar10_dir(tmp_path):
    write_cifar10_folder(tmp_path / "cifar10-jpeg", per_class=(12, 6))
    return tmp_path


def test_label_shift_on_cifar10_with_two_clusters_is_vehicles_vs_animals(cifar10_dir):
    scenario = build_scenario(
        RunConfig(dataset="cifar10", num_clusters=2, clients_per_cluster=2, data_dir=str(cifar10_dir))
    )
    assert scenario.cluster_descriptions == (
        "classes airplane,automobile,ship,truck",
        "classes bird,cat,deer,dog,frog,horse",
    )


def test_covariate_subclass_labels_by_superclass_and_splits_subclasses(cifar10_dir):
    config = RunConfig(dataset="cifar10", scenario="covariate-subclass", num_clusters=2, clients_per_cluster=2,
                       data_dir=str(cifar10_dir))  # fmt: skip
    scenario = build_scenario(config)
    dataset = load_dataset("cifar10", cifar10_dir)
    assert scenario.num_classes == 2
    seen = [
        set(dataset.train_y[np.concatenate([c.train_indices for c in scenario.clients if c.cluster == k])])
        for k in (0, 1)
    ]
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(10))  # disjoint subclasses, all covered
    for k in (0, 1):  # both clusters see vehicles and animals
        assert {dataset.superclass_of[c] for c in seen[k]} == {0, 1}
    client = scenario.clients[0]
    assert list(client.label_map) == list(dataset.superclass_of)
    for client in scenario.clients:  # test samples come from the client's own subclasses
        assert set(dataset.test_y[client.test_indices]) <= seen[client.cluster]
    with pytest.raises(FedcondError, match=r"num-clusters 2\.\.4"):
        build_scenario(config.replace(num_clusters=5))
    with pytest.raises(FedcondError, match="needs superclasses"):
        build_scenario(RunConfig(scenario="covariate-subclass", num_clusters=2))


def test_combined_has_two_concepts_times_covariate_clusters(cifar10_dir):
    config = RunConfig(dataset="cifar10", scenario="combined", num_clusters=6, covariate_clusters=3,
                       clients_per_cluster=1, data_dir=str(cifar10_dir))  # fmt: skip
    scenario = build_scenario(config)
    dataset = load_dataset("cifar10", cifar10_dir)
    maps = [tuple(c.label_map) for c in scenario.clients]
    assert len(set(maps[:3])) == 1 and len(set(maps[3:])) == 1 and maps[0] != maps[3]
    for group in (scenario.clients[:3], scenario.clients[3:]):
        classes = [set(dataset.train_y[c.train_indices]) for c in group]
        assert not (classes[0] & classes[1]) and set().union(*classes) == set(range(10))
        for client in group:  # every covariate cluster still sees all three labels
            assert set(client.label_map[dataset.train_y[client.train_indices]]) == {0, 1, 2}
    with pytest.raises(FedcondError, match="set num-clusters=6"):
        build_scenario(config.replace(num_clusters=4))


def test_cifar_network_shapes():
    model = build_model((3, 32, 32), 10, 32, seed=0)
    assert model.classifier[0].in_features == 4096 + 32 and model.classifier[0].out_features == 256
    assert model(torch.zeros(4, 3, 32, 32), torch.zeros(1, 32)).shape == (4, 10)
    assert any(isinstance(layer, torch.nn.BatchNorm2d) for layer in model.features)


def test_combined_with_four_covariate_clusters_leaves_the_fourth_one_class(cifar10_dir):
    """C = 4: each label's 3 or 4 subclasses cut 4 ways; the fourth cluster of a group gets the
    fourth subclass of its 4-subclass label only (truck, in both groups), as numpy's array_split leaves it."""
    config = RunConfig(dataset="cifar10", scenario="combined", num_clusters=8, covariate_clusters=4,
                       clients_per_cluster=1, data_dir=str(cifar10_dir))  # fmt: skip
    scenario = build_scenario(config)
    dataset = load_dataset("cifar10", cifar10_dir)
    seen = [{CIFAR10_CLASSES[c] for c in dataset.train_y[client.train_indices]} for client in scenario.clients]
    assert seen[3] == seen[7] == {"truck"}
    assert all(len(classes) == 3 for classes in seen[:3] + seen[4:7])
    with pytest.raises(FedcondError, match=r"covariate-clusters 1\.\.4"):
        build_scenario(config.replace(num_clusters=10, covariate_clusters=5))


def test_a_reserved_encoder_learns_from_images_no_client_holds(cifar10_dir, monkeypatch):
    """fingerprint-encoder=cifar10-reserved: a fifth of every class is held back from every client
    and is exactly what the encoder trains on; every other encoder leaves the split as it was."""
    from fedcond.fingerprint import encoder

    dataset = load_dataset("cifar10", cifar10_dir)
    reserved = encoder.reserved_train_indices(dataset.train_y)
    assert np.bincount(dataset.train_y[reserved]).tolist() == [2] * 10  # round(12 * 0.2) per class
    for scenario_settings in ({"scenario": "label-shift", "num_clusters": 2},
                              {"scenario": "combined", "num_clusters": 4, "covariate_clusters": 2}):  # fmt: skip
        config = RunConfig(dataset="cifar10", clients_per_cluster=2, data_dir=str(cifar10_dir), **scenario_settings)
        plain = build_scenario(config)
        held = build_scenario(config.replace(fingerprint_encoder="cifar10-reserved"))
        held_train = np.concatenate([client.train_indices for client in held.clients])
        assert not np.isin(held_train, reserved).any()
        plain_train = np.concatenate([client.train_indices for client in plain.clients])
        assert len(held_train) == len(plain_train) - len(reserved)
        unchanged = build_scenario(config.replace(fingerprint_encoder="cifar100"))
        pairs = zip(plain.clients, unchanged.clients, strict=True)
        assert all(np.array_equal(a.train_indices, b.train_indices) for a, b in pairs)
    trained_on = []
    monkeypatch.setitem(encoder.RESERVED_SETTINGS, "epochs", 1)
    original = encoder.as_rgb32
    monkeypatch.setattr(encoder, "as_rgb32", lambda images: trained_on.append(len(images)) or original(images))
    encoder.load_encoder.cache_clear()
    encoder.load_encoder("cifar10-reserved", cifar10_dir)
    assert sum(trained_on) == len(reserved)  # one epoch over the reserved images, nothing else


def test_reserved_encoder_splits_are_recorded_and_partition_files_checked(cifar10_dir, tmp_path):
    from fedcond.data.client_data import export_partitions, load_partition_file
    from fedcond.data.scenarios import split_settings

    config = RunConfig(dataset="cifar10", num_clusters=2, clients_per_cluster=2, data_dir=str(cifar10_dir))
    assert "fingerprint-encoder" not in split_settings(config)  # older partition files stay valid
    reserved = config.replace(fingerprint_encoder="cifar10-reserved")
    assert split_settings(reserved)["fingerprint-encoder"] == "cifar10-reserved"
    (path, *_) = export_partitions(reserved, tmp_path / "partitions")
    assert load_partition_file(path, reserved, 0).train_x.shape[0] > 0
    with pytest.raises(FedcondError, match="fingerprint-encoder 'cifar10-reserved' vs None"):
        load_partition_file(path, config, 0)


def test_cifar10_clients_fingerprint_through_the_papers_cifar100_encoder(cifar10_dir, monkeypatch):
    """fingerprint-encoder=cifar100, the paper's own choice, stays usable where CIFAR-100 is at hand:
    the encoder trains on CIFAR-100 (cached), CIFAR-10's split is untouched, and each client's
    fingerprint is read from its 128-d embedding, not its pixels."""
    from fedcond.data.client_data import client_fingerprint, load_client_data
    from fedcond.fingerprint import encoder

    write_cifar100_pickles(cifar10_dir)  # both datasets in one data-dir, as a user would lay them out
    monkeypatch.setitem(encoder.ENCODER_SETTINGS, "samples", 64)
    monkeypatch.setitem(encoder.ENCODER_SETTINGS, "epochs", 1)
    encoder.load_encoder.cache_clear()
    config = RunConfig(dataset="cifar10", num_clusters=2, clients_per_cluster=2, data_dir=str(cifar10_dir))
    through_cifar100 = config.replace(fingerprint_encoder="cifar100")
    client = load_client_data(through_cifar100, 0)
    vector = client_fingerprint(through_cifar100, client)
    assert vector.shape == (through_cifar100.fingerprint_dim,) and np.all(np.isfinite(vector))
    assert len(list(cache_dir().glob("encoder-cifar100-*.pt"))) == 1
    assert not np.allclose(vector, client_fingerprint(config, load_client_data(config, 0)))
