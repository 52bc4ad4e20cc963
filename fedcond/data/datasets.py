"""Datasets as in-memory arrays, decoded once per process.

``digits`` (scikit-learn, no files) is the embedded default. ``mnist`` and ``fashion-mnist`` are read
from a folder holding the four canonical idx ``.gz`` files: the ``data-dir`` setting or
``$FEDCOND_DATA_DIR`` (the folder itself or its ``mnist/`` / ``fashion-mnist/`` subfolder), then
Debian's ``/usr/share/datasets/fashion-mnist``, then torchvision's download where there is internet.

A decoded dataset is kept in the cache folder (``FEDCOND_CACHE_DIR``, default ``~/.cache/fedcond``)
as ``.npy`` files, keyed by the files it came from, and later processes memory-map it: a run's
CLI check, ServerApp and every Ray actor each decoded MNIST anew (1.2 s of every start-up), and
each held a private copy; mapped, they share one in the page cache.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcond.data.tabular import FEATURES, generate
from fedcond.errors import FedcondError

IDX_FILES = {
    "train_x": "train-images-idx3-ubyte.gz",
    "train_y": "train-labels-idx1-ubyte.gz",
    "test_x": "t10k-images-idx3-ubyte.gz",
    "test_y": "t10k-labels-idx1-ubyte.gz",
}


@dataclass(frozen=True)
class ArrayDataset:
    """Samples as float32 arrays, labels as int64 (a regression task's targets: float32): images
    ``(n, channels, height, width)`` in [0, 1], or tabular features ``(n, features)`` (``fedcond.data.tabular``).
    A regression task has one "class", its one output."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    class_names: tuple[str, ...]
    # The superclass of every class (CIFAR-10: vehicle/animal; CIFAR-100: its 20 official coarse
    # classes), for scenarios that label by superclass; empty where the dataset has none.
    superclass_of: tuple[int, ...] = ()
    superclass_names: tuple[str, ...] = ()
    # The synthetic tabular tasks' concept of every sample (``fedcond.data.tabular``: whose weight vector
    # labelled it), train and test; empty for the image datasets, whose labels have one meaning.
    train_concepts: np.ndarray | None = None
    test_concepts: np.ndarray | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(size) for size in self.train_x.shape[1:])


@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset is before it is loaded: enough to validate a run without touching files."""

    name: str
    num_classes: int
    #: One sample's shape: (channels, height, width) for images, (features,) for tabular data.
    input_shape: tuple[int, ...]
    # Local training defaults that learn at this dataset's size (docs/settings.md, "Per-dataset training defaults").
    local_epochs: int
    batch_size: int
    load: Callable[[Path | None], ArrayDataset]
    #: What identifies the files ``load`` would read (None: found nowhere yet, or not cached):
    #: the key of the decoded copy in the cache folder.
    source: Callable[[Path | None], str | None] = lambda _data_dir: None
    #: ``channels-last = "auto"``: whether this dataset's CNN trains in the channels-last layout
    #: (CIFAR: 904 against 665 images/s on CPU, and three seeds of E4b's quick profile agreed to 3
    #: decimals, experiments/results/channels-last; one-channel images gain nothing from it).
    channels_last: bool = False
    #: Real-valued targets, one output, squared-error loss and RMSE (lower is better) for metric;
    #: else classes, cross-entropy and accuracy.
    regression: bool = False

    @property
    def metric(self) -> str:
        """The name the per-client score has in history.csv, reports and plots."""
        return "rmse" if self.regression else "accuracy"

    @property
    def tabular(self) -> bool:
        """Feature vectors, not images: an MLP-sized model, no convolutions, no image encoder."""
        return len(self.input_shape) == 1


def _load_digits(_data_dir: Path | None) -> ArrayDataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    # Digits has no official split: a fixed stratified half/half split keeps per-client test sets
    # large enough to measure (a client of 15 holds ~60 test samples) and never changes with `seed`.
    train_x, test_x, train_y, test_y = train_test_split(images, labels, test_size=0.5, stratify=labels, random_state=0)
    names = tuple(str(label) for label in range(10))
    return ArrayDataset("digits", train_x, train_y, test_x, test_y, names)


def read_idx_gz(path: Path) -> np.ndarray:
    """Decode one gzipped idx file (the MNIST format) with full integrity checks."""
    try:
        with gzip.open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        raise FedcondError(f"missing data file {path}") from None
    except (OSError, EOFError, zlib.error) as error:
        raise FedcondError(f"{path} is truncated or corrupt ({error}); replace it with a fresh copy") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise FedcondError(f"{path} is not an unsigned-byte idx file; replace it with a fresh copy")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise FedcondError(f"{path} is truncated (short header); replace it with a fresh copy")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(shape))
    if len(raw) - header != expected:
        raise FedcondError(
            f"{path} holds {len(raw) - header} bytes of data but its header says {expected}; "
            "replace it with a fresh copy"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _idx_folder_candidates(name: str, data_dir: Path | None) -> list[Path]:
    """Folders that may hold ``name``'s idx files, most specific first."""
    candidates: list[Path] = []
    if data_dir is not None:
        candidates += [data_dir / name, data_dir]
    if name == "fashion-mnist":
        candidates.append(Path("/usr/share/datasets/fashion-mnist"))
    return candidates


def _find_idx_folder(name: str, data_dir: Path | None) -> Path | None:
    """The first candidate folder that holds all four idx files, if any."""
    return next((folder for folder in _idx_folder_candidates(name, data_dir) if _has_idx_files(folder)), None)


def _idx_source(name: str) -> Callable[[Path | None], str | None]:
    def source(data_dir: Path | None) -> str | None:
        if data_dir is not None and not data_dir.is_dir():
            return None  # load() says the folder does not exist (never a copy from another folder)
        folder = _find_idx_folder(name, data_dir)
        # None: not here, and load() says what is missing, or downloads.
        return None if folder is None else _files_key(name, [folder / filename for filename in IDX_FILES.values()])

    return source


def _digits_source(_data_dir: Path | None) -> str:
    from importlib.metadata import version

    return f"digits-scikit-learn-{version('scikit-learn')}"


def _files_key(name: str, files: list[Path]) -> str:
    """``name`` plus a digest of where the files are, their sizes and modification times."""
    described = []
    for file in files:
        stat = file.stat()
        described.append((str(file.resolve()), stat.st_size, stat.st_mtime_ns))
    return f"{name}-{hashlib.sha256(repr(described).encode()).hexdigest()[:16]}"


def _has_idx_files(folder: Path) -> bool:
    return all((folder / filename).is_file() for filename in IDX_FILES.values())


def _download_idx_folder(name: str) -> Path:
    """Let torchvision fetch the canonical idx files; it stores them as ``<root>/<Class>/raw``."""
    from torchvision import datasets as tv_datasets

    from fedcond.data.cifar import cache_dir

    root = cache_dir()
    dataset_class = {"mnist": tv_datasets.MNIST, "fashion-mnist": tv_datasets.FashionMNIST}[name]
    for train in (True, False):
        dataset_class(root=str(root), train=train, download=True)
    return root / dataset_class.__name__ / "raw"


def _locate_idx_folder(name: str, data_dir: Path | None) -> Path:
    if data_dir is not None and not data_dir.is_dir():
        raise FedcondError(
            f"data-dir {data_dir} does not exist; set data-dir to the folder holding the {name} idx .gz files"
        )
    folder = _find_idx_folder(name, data_dir)
    if folder is not None:
        return folder
    if data_dir is not None:
        missing = ", ".join(IDX_FILES.values())
        raise FedcondError(
            f"no {name} idx files in {data_dir} or {data_dir / name}; put {missing} there "
            "or point data-dir / FEDCOND_DATA_DIR at the folder that holds them"
        )
    try:
        return _download_idx_folder(name)
    except Exception as error:
        hint = "apt-get install -y dataset-fashion-mnist, or " if name == "fashion-mnist" else ""
        raise FedcondError(
            f"{name} is not available offline and could not be downloaded ({type(error).__name__}); "
            f"{hint}set data-dir or FEDCOND_DATA_DIR to a folder holding the four idx .gz files"
        ) from None


def _idx_loader(name: str, class_names: tuple[str, ...]) -> Callable[[Path | None], ArrayDataset]:
    def load(data_dir: Path | None) -> ArrayDataset:
        folder = _locate_idx_folder(name, data_dir)
        arrays = {key: read_idx_gz(folder / filename) for key, filename in IDX_FILES.items()}
        for split in ("train", "test"):
            images, labels = arrays[f"{split}_x"], arrays[f"{split}_y"]
            if images.ndim != 3 or len(images) != len(labels):
                raise FedcondError(
                    f"{folder}: {split} images {images.shape} do not match labels {labels.shape}; "
                    "replace the files with a fresh copy"
                )
            if labels.max() >= len(class_names):
                raise FedcondError(f"{folder}: {split} labels exceed {len(class_names)} classes; wrong files?")
        return _grey_dataset(name, arrays, class_names)

    return load


def _grey_dataset(
    name: str,
    arrays: dict[str, np.ndarray],
    class_names: tuple[str, ...],
    superclass_of: tuple[int, ...] = (),
    superclass_names: tuple[str, ...] = (),
) -> ArrayDataset:
    """Decoded idx arrays, uint8 images (n, height, width), as a dataset: pixels in [0, 1] with a
    channel axis added after the scaling (the strides fedcond.data.datasets' cache keeps)."""
    return ArrayDataset(
        name,
        (arrays["train_x"].astype(np.float32) / 255.0)[:, None, :, :],
        arrays["train_y"].astype(np.int64),
        (arrays["test_x"].astype(np.float32) / 255.0)[:, None, :, :],
        arrays["test_y"].astype(np.int64),
        class_names,
        superclass_of,
        superclass_names,
    )


def _cifar10(data_dir: Path | None) -> ArrayDataset:
    from fedcond.data.cifar import CIFAR10_CLASSES, load_cifar10_arrays

    arrays = load_cifar10_arrays(data_dir)
    vehicles = {"airplane", "automobile", "ship", "truck"}
    superclass_of = tuple(0 if name in vehicles else 1 for name in CIFAR10_CLASSES)
    return _from_uint8("cifar10", arrays, CIFAR10_CLASSES, superclass_of, ("vehicle", "animal"))


def _cifar100(data_dir: Path | None) -> ArrayDataset:
    from fedcond.data.cifar import load_cifar100_arrays

    arrays = load_cifar100_arrays(data_dir)
    return _from_uint8(
        "cifar100",
        arrays,
        tuple(str(name) for name in arrays["class_names"]),
        tuple(int(k) for k in arrays["superclass_of"]),
        tuple(str(name) for name in arrays["superclass_names"]),
    )


def _from_uint8(
    name: str,
    arrays: dict[str, np.ndarray],
    class_names: tuple[str, ...],
    superclass_of: tuple[int, ...],
    superclass_names: tuple[str, ...],
) -> ArrayDataset:
    return ArrayDataset(
        name,
        arrays["train_x"].astype(np.float32) / 255.0,
        arrays["train_y"].astype(np.int64),
        arrays["test_x"].astype(np.float32) / 255.0,
        arrays["test_y"].astype(np.int64),
        class_names,
        superclass_of,
        superclass_names,
    )


#: EMNIST's splits that fedcond loads: its 47 balanced classes (Table VIII: digits, uppercase and the
#: 11 lowercase letters not merged into their capitals) and by-class's 62 (Table IX's look-alike
#: lowercase characters, o, l, z, s, k, c, p, exist in by-class only).
EMNIST_SPLITS = {"emnist-balanced": "balanced", "emnist-byclass": "byclass"}
EMNIST_CASES = ("digit", "uppercase", "lowercase")


def emnist_files(split: str) -> dict[str, str]:
    """The canonical EMNIST file names of ``split`` (the gzip distribution's ``gzip/`` folder)."""
    return {
        **{key: f"emnist-{split}-{name}" for key, name in IDX_FILES.items()},
        "mapping": f"emnist-{split}-mapping.txt",
    }


def _emnist_folder(name: str, data_dir: Path | None) -> Path:
    files = emnist_files(EMNIST_SPLITS[name])
    candidates = (
        [] if data_dir is None else [data_dir / "emnist", data_dir / "emnist" / "gzip", data_dir, data_dir / "gzip"]
    )
    for folder in candidates:
        if all((folder / file).is_file() for file in files.values()):
            return folder
    where = "data-dir is not set" if data_dir is None else f"not in {data_dir}, its emnist/ or gzip/ folders"
    raise FedcondError(
        f"{name} has no offline copy here and cannot be downloaded: put {', '.join(files.values())} "
        f"(the canonical EMNIST gzip files) in data-dir/emnist ({where})"
    )


def _emnist_source(name: str) -> Callable[[Path | None], str | None]:
    def source(data_dir: Path | None) -> str | None:
        try:
            folder = _emnist_folder(name, data_dir)
        except FedcondError:
            return None  # load() says what is missing
        return _files_key(name, [folder / file for file in emnist_files(EMNIST_SPLITS[name]).values()])

    return source


def _emnist_loader(name: str) -> Callable[[Path | None], ArrayDataset]:
    def load(data_dir: Path | None) -> ArrayDataset:
        folder = _emnist_folder(name, data_dir)
        files = emnist_files(EMNIST_SPLITS[name])
        characters = _emnist_mapping(folder / files["mapping"])
        arrays = {key: read_idx_gz(folder / files[key]) for key in IDX_FILES}
        for split in ("train", "test"):
            images, labels = arrays[f"{split}_x"], arrays[f"{split}_y"]
            if images.ndim != 3 or images.shape[1:] != (28, 28) or len(images) != len(labels):
                raise FedcondError(f"{folder}: {split} files are not 28x28 images with one label each; wrong files?")
            if labels.max() >= len(characters):
                raise FedcondError(f"{folder}: {split} labels exceed the {len(characters)} classes of its mapping file")
        # EMNIST stores each image transposed (column-major): transposed back, characters stand upright.
        upright = {key: np.ascontiguousarray(arrays[key].transpose(0, 2, 1)) for key in ("train_x", "test_x")}
        case_of = tuple(
            0 if character.isdigit() else 1 if character.isupper() else 2 for character in characters
        )  # fmt: skip
        return _grey_dataset(name, {**arrays, **upright}, characters, case_of, EMNIST_CASES)

    return load


def _emnist_mapping(path: Path) -> tuple[str, ...]:
    """The character of every label: the mapping file's lines are ``label ascii-code``, labels 0..n-1."""
    try:
        pairs = [line.split() for line in path.read_text().splitlines() if line.strip()]
        codes = {int(label): int(code) for label, code in pairs}
    except (OSError, ValueError) as error:
        raise FedcondError(f"{path} is not an EMNIST mapping file (lines 'label ascii-code'): {error}") from None
    if sorted(codes) != list(range(len(codes))):
        raise FedcondError(f"{path} does not map the labels 0..{len(codes) - 1} each once; replace it")
    return tuple(chr(codes[label]) for label in range(len(codes)))


def synthetic_dataset(task: str) -> ArrayDataset:
    """One of the appendix's synthetic tabular tasks (``fedcond.data.tabular``): generated, never read."""
    arrays = generate(task)
    outputs = ("y",) if task == "linear" else ("0", "1")
    return ArrayDataset(
        f"synthetic-{task}", arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"], outputs,
        train_concepts=arrays["train_concepts"], test_concepts=arrays["test_concepts"],
    )  # fmt: skip


FASHION_CLASSES = (
    "t-shirt/top", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
)  # fmt: skip

DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        # Digits clients hold ~60 samples: 5 epochs of batch 16 learn; 1 epoch of 64 does not.
        DatasetSpec("digits", 10, (1, 8, 8), local_epochs=5, batch_size=16, load=_load_digits, source=_digits_source),
        DatasetSpec(
            "mnist", 10, (1, 28, 28), local_epochs=1, batch_size=64,
            load=_idx_loader("mnist", tuple(str(label) for label in range(10))), source=_idx_source("mnist"),
        ),
        DatasetSpec(
            "fashion-mnist", 10, (1, 28, 28), local_epochs=1, batch_size=64,
            load=_idx_loader("fashion-mnist", FASHION_CLASSES), source=_idx_source("fashion-mnist"),
        ),
        DatasetSpec("cifar10", 10, (3, 32, 32), local_epochs=1, batch_size=64, load=_cifar10, channels_last=True),
        DatasetSpec("cifar100", 100, (3, 32, 32), local_epochs=1, batch_size=64, load=_cifar100, channels_last=True),
        # EMNIST (the appendix's Tables VIII-IX), from a folder the user points to; superclasses are the
        # characters' cases, so label-shift with num-clusters=3 is the appendix's digit / upper / lower.
        *(
            DatasetSpec(
                name, {"emnist-balanced": 47, "emnist-byclass": 62}[name], (1, 28, 28), local_epochs=1,
                batch_size=64, load=_emnist_loader(name), source=_emnist_source(name),
            )
            for name in EMNIST_SPLITS
        ),
        # The appendix's synthetic tasks (fedcond.data.tabular): 100 samples per client, 10 features.
        DatasetSpec(
            "synthetic-linear", 1, (FEATURES,), local_epochs=5, batch_size=16,
            load=lambda _data_dir: synthetic_dataset("linear"), source=lambda _data_dir: None, regression=True,
        ),
        DatasetSpec(
            "synthetic-logistic", 2, (FEATURES,), local_epochs=5, batch_size=16,
            load=lambda _data_dir: synthetic_dataset("logistic"), source=lambda _data_dir: None,
        ),
    )
}  # fmt: skip


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of a known dataset, or a one-line error listing the known ones."""
    try:
        return DATASETS[name]
    except KeyError:
        raise FedcondError(f"unknown dataset '{name}'; choose one of {', '.join(DATASETS)}") from None


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: Path | None = None) -> ArrayDataset:
    """Decode ``name`` once per process; every client of a Ray actor reuses the same arrays.

    Decoded once per machine, too: later processes map the cached copy (module docstring)."""
    spec = dataset_spec(name)
    key = spec.source(data_dir)
    dataset = _read_decoded(name, key) if key else None
    if dataset is None:
        dataset = spec.load(data_dir)
        if key:
            _write_decoded(dataset, key)
    for array in (dataset.train_x, dataset.train_y, dataset.test_x, dataset.test_y):
        array.setflags(write=False)  # shared by all clients of the process: nobody may mutate it
    return dataset


#: The arrays of a decoded dataset, one .npy file each, beside meta.json (names, superclasses).
_ARRAYS = ("train_x", "train_y", "test_x", "test_y")
_DECODED_FORMAT = 2  # bump when the decoded arrays change (e.g. another scaling): old copies are ignored


def _decoded_folder(key: str) -> Path:
    from fedcond.data.cifar import cache_dir

    return cache_dir() / "decoded" / f"{key}-v{_DECODED_FORMAT}"


def _read_decoded(name: str, key: str) -> ArrayDataset | None:
    folder = _decoded_folder(key)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        arrays = {
            array: _with_strides(np.load(folder / f"{array}.npy", mmap_mode="r"), meta["strides"][array])
            for array in _ARRAYS
        }
    except (OSError, ValueError, KeyError):
        return None  # not there (or unreadable): decode from the source files again
    return ArrayDataset(
        name, **arrays, class_names=tuple(meta["class_names"]), superclass_of=tuple(meta["superclass_of"]),
        superclass_names=tuple(meta["superclass_names"]),
    )  # fmt: skip


def _with_strides(mapped: np.ndarray, strides: list[int]) -> np.ndarray:
    """``mapped`` with the decoder's own strides, which may differ on axes of size 1 (where a stride
    addresses nothing): MNIST's ``[:, None]`` channel axis has stride 4, and torch takes an image
    tensor whose channel stride is 1 element for channels-last, whose kernels round differently (and
    run 30% faster here). A mapped copy with the .npy file's strides would train to other numbers."""
    if tuple(strides) == mapped.strides:
        return np.asarray(mapped)
    if len(strides) != mapped.ndim or any(
        size != 1 and stride != own for size, stride, own in zip(mapped.shape, strides, mapped.strides, strict=True)
    ):
        raise ValueError("the recorded strides do not describe the stored array")
    return np.lib.stride_tricks.as_strided(np.asarray(mapped), strides=tuple(strides), writeable=False)


def _write_decoded(dataset: ArrayDataset, key: str) -> None:
    """Write the decoded copy into a folder of its own, then rename it into place: a process that
    reads it never sees half of it, and of two processes writing at once one wins."""
    folder = _decoded_folder(key)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True, exist_ok=True)
        for array in _ARRAYS:
            np.save(partial / f"{array}.npy", getattr(dataset, array))
        meta = {"class_names": list(dataset.class_names), "superclass_of": list(dataset.superclass_of),
                "superclass_names": list(dataset.superclass_names),
                "strides": {array: list(getattr(dataset, array).strides) for array in _ARRAYS}}  # fmt: skip
        (partial / "meta.json").write_text(json.dumps(meta))
        partial.rename(folder)
    except OSError:
        pass  # a full disk, a read-only home or another process first: the next process decodes again
    finally:
        shutil.rmtree(partial, ignore_errors=True)
