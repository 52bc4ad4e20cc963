"""One client's own arrays: its partition of the dataset with its label map and rotation applied.

A client computes its partition from the whole dataset (``load_client_data``: the split is a
function of the dataset and the seed), or reads it from a partition file that holds nothing but
its own arrays (``load_partition_file``), written beforehand by ``export_partitions``: what a
client on its own machine uses, so that machine never holds another client's samples.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedcond.config import RunConfig
from fedcond.data.datasets import dataset_spec, load_dataset
from fedcond.data.scenarios import SPLIT_KEYS, ClientPartition, scenario_for, split_settings
from fedcond.errors import FedcondError


@dataclass(frozen=True)
class ClientData:
    """What a client holds locally; nothing here is ever sent."""

    partition_id: int
    cluster: int
    num_classes: int
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    #: The share of its training data held out for choosing settings (``validation-fraction``; empty
    #: without): scored every round, never trained on nor fingerprinted.
    validation_x: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    validation_y: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        arrays = (self.train_x, self.train_y, self.test_x, self.test_y, self.validation_x, self.validation_y)
        return sum(array.nbytes for array in arrays)

    @property
    def has_validation(self) -> bool:
        return len(self.validation_y) > 0


def rotate_images(images: np.ndarray, degrees: float) -> np.ndarray:
    """Rotate ``(n, c, h, w)`` images counter-clockwise; exact for multiples of 90 degrees."""
    if degrees % 360 == 0:
        return images
    if degrees % 90 == 0:
        return np.ascontiguousarray(np.rot90(images, k=int(degrees // 90) % 4, axes=(2, 3)))
    from scipy.ndimage import rotate

    rotated = rotate(images, degrees, axes=(3, 2), reshape=False, order=1, mode="constant", cval=0.0)
    return np.clip(rotated, 0.0, 1.0).astype(images.dtype)


def client_data_from_partition(
    partition: ClientPartition,
    images: tuple[np.ndarray, np.ndarray],
    labels: tuple[np.ndarray, np.ndarray],
    num_classes: int,
) -> ClientData:
    """Slice the train/test ``images`` and ``labels`` by the partition's indices (a regression task's
    real-valued targets as they are: a label map maps classes)."""
    (train_images, test_images), (train_labels, test_labels) = images, labels

    def mapped(targets: np.ndarray) -> np.ndarray:
        return targets if np.issubdtype(targets.dtype, np.floating) else partition.label_map[targets]

    return ClientData(
        partition_id=partition.partition_id,
        cluster=partition.cluster,
        num_classes=num_classes,
        train_x=rotate_images(train_images[partition.train_indices], partition.rotation),
        train_y=mapped(train_labels[partition.train_indices]),
        test_x=rotate_images(test_images[partition.test_indices], partition.rotation),
        test_y=mapped(test_labels[partition.test_indices]),
        **(
            {
                "validation_x": rotate_images(train_images[partition.validation_indices], partition.rotation),
                "validation_y": mapped(train_labels[partition.validation_indices]),
            }
            if len(partition.validation_indices)
            else {}
        ),
    )


def load_client_data(config: RunConfig, partition_id: int) -> ClientData:
    """The data of client ``partition_id`` under ``config``'s dataset and scenario."""
    scenario = scenario_for(config)
    partition = scenario.client(partition_id)
    dataset = load_dataset(partition.source, config.resolved_data_dir())
    return client_data_from_partition(
        partition,
        (dataset.train_x, dataset.test_x),
        (dataset.train_y, dataset.test_y),
        scenario.num_classes,
    )


#: Bytes of client arrays one process keeps between messages (a Ray actor serves many clients in
#: turn): bounded so that an actor's memory does not grow with the number of clients.
PARTITION_CACHE_BYTES = 128 * 2**20


def reuse_enabled() -> bool:
    """Whether a process reuses partitions and models between messages (``FEDCOND_REUSE=0``: not,
    for measuring what reuse saves; the numbers are the same either way)."""
    return os.environ.get("FEDCOND_REUSE", "1") != "0"


class _PartitionCache:
    """Least recently used ``ClientData`` by (split settings, data folder, partition id), at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[object, ...], ClientData] = OrderedDict()
        self.bytes = 0

    def get(self, config: RunConfig, partition_id: int) -> ClientData:
        key = (*split_settings(config).values(), str(config.resolved_data_dir()), partition_id)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        data = load_client_data(config, partition_id)
        if data.nbytes <= self.max_bytes:
            self.entries[key] = data
            self.bytes += data.nbytes
            while self.bytes > self.max_bytes:
                _, evicted = self.entries.popitem(last=False)
                self.bytes -= evicted.nbytes
        return data


_PARTITIONS = _PartitionCache(PARTITION_CACHE_BYTES)


def cached_client_data(config: RunConfig, partition_id: int) -> ClientData:
    """``load_client_data``, kept for the next message to this client in this process.

    The scenario (every client's indices) is built once per process already; this also keeps the
    sliced, label-mapped and rotated arrays (a non-right-angle rotation costs tens of ms per
    message). Callers must not modify the arrays: the next message gets the same ones.
    """
    if not reuse_enabled():
        return load_client_data(config, partition_id)
    return _PARTITIONS.get(config, partition_id)


def partition_file_name(partition_id: int) -> str:
    return f"partition-{partition_id}.npz"


def save_partition(data: ClientData, config: RunConfig, path: Path) -> None:
    """Write one client's arrays (labels already mapped, images already rotated) and the split's settings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = json.dumps(split_settings(config), sort_keys=True)
    # Only a split with validation writes its arrays: every other file is as it always was.
    validation = {"validation_x": data.validation_x, "validation_y": data.validation_y} if data.has_validation else {}
    with path.open("wb") as handle:  # an open handle keeps numpy from appending a second ".npz"
        np.savez_compressed(
            handle,
            train_x=data.train_x, train_y=data.train_y, test_x=data.test_x, test_y=data.test_y, **validation,
            partition_id=data.partition_id, cluster=data.cluster, num_classes=data.num_classes,
            settings=np.array(settings),
        )  # fmt: skip


def export_partitions(config: RunConfig, folder: Path) -> list[Path]:
    """One ``partition-<i>.npz`` per client of ``config``: copy file i to client machine i."""
    return [
        _export_one(config, partition_id, folder / partition_file_name(partition_id))
        for partition_id in range(config.num_clients)
    ]


def _export_one(config: RunConfig, partition_id: int, path: Path) -> Path:
    save_partition(load_client_data(config, partition_id), config, path)
    return path


def load_partition_file(path: Path, config: RunConfig, partition_id: int) -> ClientData:
    """A client's data from its exported file, refused unless it is partition ``partition_id`` of ``config``'s split."""
    fix = "export the partitions again with the run's settings (fedcond export-partitions)"
    try:
        with np.load(path, allow_pickle=False) as stored:
            arrays = {key: stored[key] for key in stored.files}
    except FileNotFoundError:
        raise FedcondError(f"no partition file {path}; copy this client's partition-<id>.npz there") from None
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise FedcondError(f"{path} is not a readable partition file ({error}); {fix}") from None
    missing = {"train_x", "train_y", "test_x", "test_y", "partition_id", "cluster", "num_classes", "settings"}
    if config.validation_fraction:
        missing |= {"validation_x", "validation_y"}
    missing -= set(arrays)
    if missing:
        raise FedcondError(f"{path} lacks {', '.join(sorted(missing))}; {fix}")
    stored_id = int(arrays["partition_id"])
    if stored_id != partition_id:
        raise FedcondError(
            f"{path} holds partition {stored_id} but this node has partition-id={partition_id}; "
            "give the node its own file or fix its partition-id"
        )
    stored_settings = json.loads(str(arrays["settings"]))
    wanted = split_settings(config)
    extra = sorted((stored_settings.keys() | wanted.keys()) - set(SPLIT_KEYS))  # a reserved encoder's
    differing = [f"{key} {stored_settings.get(key)!r} vs {wanted.get(key)!r}" for key in (*SPLIT_KEYS, *extra)
                 if stored_settings.get(key) != wanted.get(key)]  # fmt: skip
    if differing:
        raise FedcondError(f"{path} was exported for another split ({'; '.join(differing)}); {fix}")
    check_partition_arrays(arrays, config, f"{path}", fix)
    return ClientData(
        partition_id=stored_id,
        cluster=int(arrays["cluster"]),
        num_classes=int(arrays["num_classes"]),
        train_x=arrays["train_x"],
        train_y=arrays["train_y"],
        test_x=arrays["test_x"],
        test_y=arrays["test_y"],
        **{key: arrays[key] for key in ("validation_x", "validation_y") if config.validation_fraction},
    )


def check_partition_arrays(arrays: dict[str, np.ndarray], config: RunConfig, where: str, fix: str) -> None:
    """Refuse a partition file whose arrays could not have come from ``export_partitions``.

    The file comes from another machine: labels out of range would index past the model's outputs
    (or silently train on nothing), and NaN, infinite or out-of-[0, 1] pixels would poison the
    fingerprint and the global model. Every image the split produces is in [0, 1] (rotations clip);
    a tabular task's features need only be finite.
    """
    spec = dataset_spec(config.dataset)
    num_classes = int(arrays["num_classes"])
    # No scenario has more classes than its dataset (superclasses, groupings and domains have fewer or as many).
    if not 1 <= num_classes <= spec.num_classes:
        raise FedcondError(f"{where} claims {num_classes} classes, {config.dataset} has {spec.num_classes}; {fix}")
    for split in ("train", "test", *(("validation",) if config.validation_fraction else ())):
        images, labels = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if images.shape[1:] != spec.input_shape or labels.shape != images.shape[:1]:
            raise FedcondError(
                f"{where}: {split} arrays have shapes {images.shape} and {labels.shape}, expected (n, "
                f"{', '.join(map(str, spec.input_shape))}) images and n labels; {fix}"
            )
        if spec.regression:
            if not np.issubdtype(labels.dtype, np.floating) or not np.isfinite(labels).all():
                raise FedcondError(f"{where}: {split} targets must be finite real numbers; {fix}")
        elif not np.issubdtype(labels.dtype, np.integer) or not np.issubdtype(images.dtype, np.floating):
            raise FedcondError(f"{where}: {split} labels must be integers and images floats; {fix}")
        elif labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise FedcondError(
                f"{where}: {split} labels run from {labels.min()} to {labels.max()}, "
                f"outside 0..{num_classes - 1}; {fix}"
            )
        if not np.isfinite(images).all():
            raise FedcondError(f"{where}: {split} images hold NaN or infinite pixels; {fix}")
        # Tabular features are real numbers of any sign (fedcond.data.tabular: Gaussian); pixels lie in [0, 1].
        if not spec.tabular and images.size and (images.min() < 0 or images.max() > 1):
            raise FedcondError(
                f"{where}: {split} pixels run from {images.min():g} to {images.max():g}, outside [0, 1]; {fix}"
            )


def client_fingerprint(config: RunConfig, data: ClientData) -> np.ndarray:
    """The raw fingerprint of one client's training data, as the client computes it (never sent).

    phi(x) is the pixels or the frozen encoder's embedding (``fingerprint-encoder``); fingerprints
    that need no data (the controls) look at none.
    """
    from fedcond.fingerprint import fingerprints as fp

    features = data.train_x
    if fp.fingerprint_spec(config.fingerprint).needs_data and config.fingerprint_encoder != "pixels":
        from fedcond.fingerprint.encoder import embed

        features = embed(data.train_x, config.fingerprint_encoder, config.resolved_data_dir())
    sample = fp.ClientSample(
        features, data.train_y, data.num_classes, config.fingerprint_dim, config.seed,
        data.partition_id, data.cluster, config.num_clusters,
    )  # fmt: skip
    return fp.compute_fingerprint(config.fingerprint, sample)
