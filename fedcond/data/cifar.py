"""CIFAR-10 and CIFAR-100 as arrays: from image folders or torchvision's pickled format.

CIFAR-10 is read from a folder of ``{train,test}/<class name>/*.jpg`` images (the layout of the
offline JPEG copy) or from torchvision's ``cifar-10-batches-py``; CIFAR-100 from torchvision's
``cifar-100-python`` (fine and coarse labels). Decoded arrays are cached as ``.npz`` outside the
repository (``$FEDCOND_CACHE_DIR``, default ``~/.cache/fedcond``), keyed by the source folder.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedcond.errors import FedcondError

CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip


def cache_dir() -> Path:
    """Where decoded datasets, downloads and trained encoders are kept, outside the repository."""
    return Path(os.environ.get("FEDCOND_CACHE_DIR", Path.home() / ".cache" / "fedcond"))


def _cached(key: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``build()``'s arrays, decoded once and then read from an .npz in the cache folder."""
    path = cache_dir() / f"{key}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as stored:
                return {name: stored[name] for name in stored.files}
        except (OSError, ValueError):
            path.unlink(missing_ok=True)  # a cache file cut short by an interrupted run: rebuild it
    arrays = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, **arrays)
    partial.replace(path)  # atomic: parallel processes never read half a file
    return arrays


def _folder_key(prefix: str, folder: Path) -> str:
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
    return f"{prefix}-{digest}"


def _decode_image_folder(folder: Path, class_names: tuple[str, ...]) -> dict[str, np.ndarray]:
    from PIL import Image, UnidentifiedImageError

    arrays: dict[str, np.ndarray] = {}
    for split in ("train", "test"):
        images, labels = [], []
        for label, name in enumerate(class_names):
            class_folder = folder / split / name
            files = sorted(class_folder.glob("*.jpg")) + sorted(class_folder.glob("*.png"))
            if not files:
                raise FedcondError(f"no images in {class_folder}; expected {{train,test}}/<class>/*.jpg under {folder}")
            for file in files:
                try:
                    with Image.open(file) as image:
                        images.append(np.asarray(image.convert("RGB"), dtype=np.uint8))
                except (OSError, UnidentifiedImageError):
                    raise FedcondError(f"{file} is not a readable image; replace it or remove it") from None
                labels.append(label)
        stacked = np.stack(images)
        if stacked.shape[1:] != (32, 32, 3):
            raise FedcondError(f"images under {folder / split} are {stacked.shape[1:3]}, CIFAR needs 32x32")
        arrays[f"{split}_x"] = stacked.transpose(0, 3, 1, 2)
        arrays[f"{split}_y"] = np.array(labels, dtype=np.int64)
    return arrays


def _unpickle(path: Path) -> dict:
    try:
        with path.open("rb") as handle:
            return pickle.load(handle, encoding="bytes")
    except FileNotFoundError:
        raise FedcondError(f"missing data file {path}") from None
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        raise FedcondError(f"{path} is truncated or corrupt ({error}); replace it with a fresh copy") from None


def _pixels(batch: dict, path: Path) -> np.ndarray:
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise FedcondError(f"{path} does not hold 32x32 RGB rows; replace it with a fresh copy")
    return data.reshape(-1, 3, 32, 32)


def _decode_cifar10_batches(folder: Path) -> dict[str, np.ndarray]:
    train = [_unpickle(folder / f"data_batch_{i}") for i in range(1, 6)]
    test = _unpickle(folder / "test_batch")
    return {
        "train_x": np.concatenate([_pixels(b, folder) for b in train]),
        "train_y": np.concatenate([np.asarray(b[b"labels"], dtype=np.int64) for b in train]),
        "test_x": _pixels(test, folder),
        "test_y": np.asarray(test[b"labels"], dtype=np.int64),
    }


def _decode_cifar100(folder: Path) -> dict[str, np.ndarray]:
    train, test = _unpickle(folder / "train"), _unpickle(folder / "test")
    meta = _unpickle(folder / "meta")
    fine = np.concatenate([train[b"fine_labels"], test[b"fine_labels"]]).astype(np.int64)
    coarse = np.concatenate([train[b"coarse_labels"], test[b"coarse_labels"]]).astype(np.int64)
    superclass_of = np.full(100, -1, dtype=np.int64)
    superclass_of[fine] = coarse
    if np.any(superclass_of < 0):
        raise FedcondError(f"{folder} does not cover all 100 fine classes; replace it with a fresh copy")
    return {
        "train_x": _pixels(train, folder),
        "train_y": np.asarray(train[b"fine_labels"], dtype=np.int64),
        "test_x": _pixels(test, folder),
        "test_y": np.asarray(test[b"fine_labels"], dtype=np.int64),
        "superclass_of": superclass_of,
        "class_names": np.array([name.decode() for name in meta[b"fine_label_names"]]),
        "superclass_names": np.array([name.decode() for name in meta[b"coarse_label_names"]]),
    }


def _download(kind: str) -> Path:
    from torchvision import datasets as tv_datasets

    root = cache_dir()
    dataset_class = {"cifar10": tv_datasets.CIFAR10, "cifar100": tv_datasets.CIFAR100}[kind]
    dataset_class(root=str(root), train=True, download=True)
    return root


def _candidates(data_dir: Path | None, names: tuple[str, ...]) -> list[Path]:
    if data_dir is None:
        return []
    return [data_dir / name for name in names] + [data_dir]


def load_cifar10_arrays(data_dir: Path | None) -> dict[str, np.ndarray]:
    """CIFAR-10 as uint8 arrays from image folders, torchvision batches, or a download."""
    for folder in _candidates(data_dir, ("cifar10-jpeg", "cifar10", "cifar-10-batches-py")):
        if (folder / "train" / "airplane").is_dir():
            return _cached(
                _folder_key("cifar10-images", folder), lambda f=folder: _decode_image_folder(f, CIFAR10_CLASSES)
            )
        if (folder / "data_batch_1").is_file():
            return _cached(_folder_key("cifar10-batches", folder), lambda f=folder: _decode_cifar10_batches(f))
        if (folder / "cifar-10-batches-py" / "data_batch_1").is_file():
            batches = folder / "cifar-10-batches-py"
            return _cached(_folder_key("cifar10-batches", batches), lambda f=batches: _decode_cifar10_batches(f))
    return _absent_or_downloaded(
        "cifar10", data_dir, "train/<class>/*.jpg image folders (or a cifar10-jpeg subfolder) or cifar-10-batches-py",
        lambda root: _decode_cifar10_batches(root / "cifar-10-batches-py"),
    )  # fmt: skip


def load_cifar100_arrays(data_dir: Path | None) -> dict[str, np.ndarray]:
    """CIFAR-100 as uint8 arrays (fine labels, plus the fine->coarse map) from torchvision's format."""
    for folder in _candidates(data_dir, ("cifar-100-python", "cifar100")):
        for candidate in (folder, folder / "cifar-100-python"):
            if (candidate / "train").is_file() and (candidate / "meta").is_file():
                return _cached(_folder_key("cifar100", candidate), lambda f=candidate: _decode_cifar100(f))
    return _absent_or_downloaded(
        "cifar100", data_dir, "torchvision's cifar-100-python folder (train, test, meta)",
        lambda root: _decode_cifar100(root / "cifar-100-python"),
    )  # fmt: skip


def _absent_or_downloaded(
    kind: str, data_dir: Path | None, expected: str, decode: Callable[[Path], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """A named data-dir without the data is an error; with none, torchvision downloads it."""
    if data_dir is not None:
        raise FedcondError(f"no {kind} under {data_dir}: expected {expected}; point data-dir at it")
    root = _try_download(kind)
    return _cached(_folder_key(f"{kind}-download", root), lambda: decode(root))


def _try_download(kind: str) -> Path:
    try:
        return _download(kind)
    except Exception as error:
        raise FedcondError(
            f"{kind} is not available offline and could not be downloaded ({type(error).__name__}); "
            "set data-dir or FEDCOND_DATA_DIR to a folder holding it"
        ) from None
