"""One client's own arrays: its partition of the dataset with its label map applied."""

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
        train_x=train_images[partition.train_indices],
        train_y=partition.label_map[train_labels[partition.train_indices]],
        test_x=test_images[partition.test_indices],
        test_y=partition.label_map[test_labels[partition.test_indices]],
    )


def load_client_data(config: RunConfig, partition_id: int) -> ClientData:
    """The data of client ``partition_id`` under ``config``'s dataset and scenario."""
    scenario = scenario_for(config)
    dataset = load_dataset(config.dataset, config.resolved_data_dir())
    return client_data_from_partition(
        scenario.client(partition_id),
        (dataset.train_x, dataset.test_x),
        (dataset.train_y, dataset.test_y),
        scenario.num_classes,
    )
