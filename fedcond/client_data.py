"""One client's own arrays: its partition of the dataset with its label map and rotation applied."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedcond.config import RunConfig
from fedcond.datasets import load_dataset
from fedcond.scenarios import ClientPartition, scenario_for


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
    """Slice the train/test ``images`` and ``labels`` by the partition's indices."""
    (train_images, test_images), (train_labels, test_labels) = images, labels
    return ClientData(
        partition_id=partition.partition_id,
        cluster=partition.cluster,
        num_classes=num_classes,
        train_x=rotate_images(train_images[partition.train_indices], partition.rotation),
        train_y=partition.label_map[train_labels[partition.train_indices]],
        test_x=rotate_images(test_images[partition.test_indices], partition.rotation),
        test_y=partition.label_map[test_labels[partition.test_indices]],
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
