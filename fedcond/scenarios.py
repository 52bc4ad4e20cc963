"""Scenarios: which client holds which samples, in which cluster, under which label map.

A scenario is a pure function of (dataset, settings, seed): every process that builds it (the
ServerApp for its summary, every ClientApp for its own partition) gets the same split.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedcond.config import RunConfig
from fedcond.datasets import ImageDataset, dataset_spec, load_dataset
from fedcond.errors import FedcondError

MIN_TRAIN_SAMPLES_PER_CLIENT = 2
MIN_TEST_SAMPLES_PER_CLIENT = 1


@dataclass(frozen=True)
class ClientPartition:
    """One client's share: indices into the dataset's train and test arrays, and its cluster.

    ``cluster`` is ground truth, used by Oracle and for reporting only; no method reads it to train.
    ``label_map`` maps the dataset's labels to the labels this client sees (identity in label shift).
    """

    partition_id: int
    cluster: int
    train_indices: np.ndarray
    test_indices: np.ndarray
    label_map: np.ndarray


@dataclass(frozen=True)
class Scenario:
    """The whole federation's layout: clusters, what each sees, and every client's partition."""

    name: str
    dataset: str
    num_classes: int
    cluster_descriptions: tuple[str, ...]
    clients: tuple[ClientPartition, ...]

    @property
    def num_clusters(self) -> int:
        return len(self.cluster_descriptions)

    def client(self, partition_id: int) -> ClientPartition:
        if not 0 <= partition_id < len(self.clients):
            raise FedcondError(
                f"partition-id {partition_id} is outside 0..{len(self.clients) - 1}; "
                "start as many nodes as num-clusters x clients-per-cluster"
            )
        return self.clients[partition_id]

    def summary(self) -> dict[str, object]:
        """What a run prints before training and stores in ``run.json``."""
        train_sizes = [len(client.train_indices) for client in self.clients]
        test_sizes = [len(client.test_indices) for client in self.clients]
        return {
            "scenario": self.name,
            "dataset": self.dataset,
            "num_clusters": self.num_clusters,
            "clients_per_cluster": len(self.clients) // self.num_clusters,
            "num_clients": len(self.clients),
            "clusters": list(self.cluster_descriptions),
            "train_samples_per_client": _min_median_max(train_sizes),
            "test_samples_per_client": _min_median_max(test_sizes),
        }


def _min_median_max(values: list[int]) -> dict[str, float]:
    return {"min": min(values), "median": float(np.median(values)), "max": max(values)}


def _split_evenly(indices: np.ndarray, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle, then cut into ``parts`` disjoint pieces whose sizes differ by at most one."""
    return [np.sort(piece) for piece in np.array_split(rng.permutation(indices), parts)]


def label_shift(dataset: ImageDataset, config: RunConfig) -> Scenario:
    """E1: K clusters receive disjoint, contiguous groups of the class list."""
    num_classes = dataset.num_classes
    if config.num_clusters > num_classes:
        raise FedcondError(
            f"label-shift needs num-clusters <= {num_classes} (the classes of {dataset.name}), "
            f"got {config.num_clusters}; lower num-clusters"
        )
    rng = np.random.default_rng(config.seed)
    class_groups = np.array_split(np.arange(num_classes), config.num_clusters)
    identity = np.arange(num_classes)
    clients: list[ClientPartition] = []
    descriptions: list[str] = []
    for cluster, classes in enumerate(class_groups):
        descriptions.append("classes " + ",".join(dataset.class_names[c] for c in classes))
        train_parts = _split_evenly(np.flatnonzero(np.isin(dataset.train_y, classes)), config.clients_per_cluster, rng)
        test_parts = _split_evenly(np.flatnonzero(np.isin(dataset.test_y, classes)), config.clients_per_cluster, rng)
        for train_indices, test_indices in zip(train_parts, test_parts, strict=True):
            clients.append(ClientPartition(len(clients), cluster, train_indices, test_indices, identity))
    return Scenario("label-shift", dataset.name, num_classes, tuple(descriptions), tuple(clients))


SCENARIOS: dict[str, Callable[[ImageDataset, RunConfig], Scenario]] = {
    "label-shift": label_shift,
}


def check_scenario_name(name: str) -> None:
    if name not in SCENARIOS:
        raise FedcondError(f"unknown scenario '{name}'; choose one of {', '.join(SCENARIOS)}")


def build_scenario(dataset: ImageDataset, config: RunConfig) -> Scenario:
    """Split ``dataset`` as ``config.scenario`` says, checking every client gets enough data."""
    check_scenario_name(config.scenario)
    scenario = SCENARIOS[config.scenario](dataset, config)
    for client in scenario.clients:
        if (
            len(client.train_indices) < MIN_TRAIN_SAMPLES_PER_CLIENT
            or len(client.test_indices) < MIN_TEST_SAMPLES_PER_CLIENT
        ):
            raise FedcondError(
                f"client {client.partition_id} gets {len(client.train_indices)} training and "
                f"{len(client.test_indices)} test samples; lower clients-per-cluster"
            )
    return scenario


def validate_without_data(config: RunConfig) -> None:
    """Every check that needs no data files: cheap enough for any entry point to run first."""
    dataset_spec(config.dataset)
    check_scenario_name(config.scenario)


@functools.lru_cache(maxsize=8)
def _cached_scenario(config: RunConfig) -> Scenario:
    return build_scenario(load_dataset(config.dataset, config.resolved_data_dir()), config)


def scenario_for(config: RunConfig) -> Scenario:
    """The scenario of a run, built once per process (a Ray actor serves many clients)."""
    # Only the settings that shape the split key the cache, so rounds and methods share it.
    key = RunConfig(
        dataset=config.dataset,
        scenario=config.scenario,
        num_clusters=config.num_clusters,
        clients_per_cluster=config.clients_per_cluster,
        seed=config.seed,
        data_dir=str(config.resolved_data_dir() or ""),
    )
    return _cached_scenario(key)
