import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from fedcond.data.datasets import IDX_FILES, dataset_spec, load_dataset, read_idx_gz
from fedcond.errors import FedcondError

SHARED_MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def write_fake_mnist(folder: Path, train: int = 40, test: int = 20) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / IDX_FILES["train_x"], rng.integers(0, 256, (train, 28, 28)))
    write_idx(folder / IDX_FILES["train_y"], np.arange(train) % 10)
    write_idx(folder / IDX_FILES["test_x"], rng.integers(0, 256, (test, 28, 28)))
    write_idx(folder / IDX_FILES["test_y"], np.arange(test) % 10)


def test_digits_needs_no_files_and_is_scaled():
    digits = load_dataset("digits")
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    assert len(digits.train_y) + len(digits.test_y) == 1797
    assert digits.train_x.min() >= 0 and digits.train_x.max() <= 1


def test_idx_folder_is_read_from_data_dir_or_its_subfolder(tmp_path):
    write_fake_mnist(tmp_path / "mnist")
    dataset = load_dataset("mnist", tmp_path)
    assert dataset.train_x.shape == (40, 1, 28, 28) and dataset.test_y.shape == (20,)
    assert dataset.train_x.dtype == np.float32 and dataset.train_x.max() <= 1.0
    assert load_dataset("mnist", tmp_path) is dataset, "decoded once per process, then cached"


def test_a_decoded_dataset_is_mapped_by_later_processes_until_its_files_change(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDCOND_CACHE_DIR", str(tmp_path / "own-cache"))  # not the session's shared copies
    write_fake_mnist(tmp_path / "mnist")
    decoded = load_dataset("mnist", tmp_path)
    (copy,) = (tmp_path / "own-cache" / "decoded").glob("mnist-*")
    load_dataset.cache_clear()  # as a new process
    mapped = load_dataset("mnist", tmp_path)
    assert not mapped.train_x.flags.writeable and not mapped.train_x.flags.owndata
    for array in ("train_x", "train_y", "test_x", "test_y"):
        ours, theirs = getattr(decoded, array), getattr(mapped, array)
        # The same strides too: torch picks its kernels (and their rounding) by them.
        assert ours.dtype == theirs.dtype and ours.strides == theirs.strides and np.array_equal(ours, theirs)
    assert mapped.class_names == decoded.class_names
    write_fake_mnist(tmp_path / "mnist", train=50)  # new files: decoded again, under another key
    load_dataset.cache_clear()
    assert load_dataset("mnist", tmp_path).train_x.shape == (50, 1, 28, 28)
    assert len(list((tmp_path / "own-cache" / "decoded").glob("mnist-*"))) == 2 and copy.is_dir()


def test_missing_idx_files_name_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FedcondError, match=r"no mnist idx files.*data-dir"):
        load_dataset("mnist", tmp_path / "empty")


def test_missing_data_dir_names_the_fix(tmp_path):
    with pytest.raises(FedcondError, match="does not exist"):
        load_dataset("fashion-mnist", tmp_path / "nowhere")
    # Never a cached copy of another folder's files (Debian's) in its place.
    assert dataset_spec("fashion-mnist").source(tmp_path / "nowhere") is None


def test_truncated_file_is_reported(tmp_path):
    write_fake_mnist(tmp_path)
    target = tmp_path / IDX_FILES["train_x"]
    target.write_bytes(target.read_bytes()[:-200])
    with pytest.raises(FedcondError, match="truncated or corrupt"):
        read_idx_gz(target)


def test_header_and_payload_disagreeing_is_reported(tmp_path):
    target = tmp_path / "bad.gz"
    with gzip.open(target, "wb") as handle:
        handle.write(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10) + bytes(5))
    with pytest.raises(FedcondError, match="header says 10"):
        read_idx_gz(target)


def test_not_an_idx_file_is_reported(tmp_path):
    target = tmp_path / "text.gz"
    with gzip.open(target, "wb") as handle:
        handle.write(b"hello world")
    with pytest.raises(FedcondError, match="not an unsigned-byte idx"):
        read_idx_gz(target)


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(FedcondError, match="choose one of digits, mnist, fashion-mnist"):
        dataset_spec("emnist")


@pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="no offline MNIST copy beside the checkout")
def test_real_mnist_offline_copy():
    mnist = load_dataset("mnist", SHARED_MNIST)
    assert mnist.train_x.shape == (60_000, 1, 28, 28) and mnist.test_x.shape == (10_000, 1, 28, 28)
    assert np.bincount(mnist.train_y).min() > 5000


# EMNIST Balanced's 47 characters, in its mapping file's order: digits, capitals, 11 lowercase letters.
BALANCED = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabdefghnqrt"


def write_fake_emnist(folder: Path, split: str = "balanced", characters: str = BALANCED, per_class: int = 2) -> None:
    """A tiny EMNIST in the canonical gzip files' format: images stored transposed, as EMNIST's are."""
    from fedcond.data.datasets import emnist_files

    files = emnist_files(split)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for part, count in (("train", per_class), ("test", 1)):
        labels = np.repeat(np.arange(len(characters)), count)
        upright = rng.integers(0, 256, (len(labels), 28, 28))
        upright[:, 0, :] = 255  # a bar along the top of every upright image
        write_idx(folder / files[f"{part}_x"], upright.transpose(0, 2, 1))
        write_idx(folder / files[f"{part}_y"], labels)
    lines = [f"{label} {ord(character)}" for label, character in enumerate(characters)]
    (folder / files["mapping"]).write_text("\n".join(lines) + "\n")


def test_emnist_loads_from_the_users_folder_upright_with_its_cases_as_superclasses(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDCOND_CACHE_DIR", str(tmp_path / "cache"))
    write_fake_emnist(tmp_path / "emnist")
    dataset = load_dataset("emnist-balanced", tmp_path)
    assert dataset.train_x.shape == (94, 1, 28, 28) and dataset.num_classes == 47
    assert (dataset.train_x[:, 0, 0, :] == 1.0).all()  # the bar is on top again: transposed back
    assert dataset.class_names[:3] == ("0", "1", "2") and dataset.class_names[-1] == "t"
    assert dataset.superclass_names == ("digit", "uppercase", "lowercase")
    assert [dataset.superclass_of.count(case) for case in range(3)] == [10, 26, 11]


def test_emnist_three_clusters_are_digits_capitals_and_lowercase(tmp_path, monkeypatch):
    from fedcond.config import RunConfig
    from fedcond.data.scenarios import build_scenario

    monkeypatch.setenv("FEDCOND_CACHE_DIR", str(tmp_path / "cache"))
    write_fake_emnist(
        tmp_path / "emnist", "byclass", "0123456789" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "abcdefghijklmnopqrstuvwxyz"
    )
    config = RunConfig(dataset="emnist-byclass", scenario="label-shift", num_clusters=3, clients_per_cluster=2,
                       data_dir=str(tmp_path))  # fmt: skip
    scenario = build_scenario(config)
    dataset = load_dataset("emnist-byclass", tmp_path)
    held = [set(dataset.class_names[label] for label in dataset.train_y[client.train_indices])
            for client in scenario.clients]  # fmt: skip
    assert set().union(*held[:2]) == set("0123456789") and set().union(*held[4:]) == set("abcdefghijklmnopqrstuvwxyz")


def test_a_missing_emnist_folder_names_the_files_it_looked_for(tmp_path):
    write_fake_emnist(tmp_path / "emnist")
    (tmp_path / "emnist" / "emnist-balanced-mapping.txt").unlink()
    with pytest.raises(
        FedcondError, match=r"put emnist-balanced-train-images-idx3-ubyte\.gz, .*emnist-balanced-mapping\.txt"
    ):
        load_dataset.__wrapped__("emnist-balanced", tmp_path)
    with pytest.raises(FedcondError, match="data-dir is not set"):
        load_dataset.__wrapped__("emnist-byclass", None)
