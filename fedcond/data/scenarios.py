"""Scenarios: which client holds which samples, in which cluster, under which label map or transform.

A scenario is a pure function of (datasets, settings, seed): every process that builds it (the
ServerApp for its summary, every ClientApp for its own partition) gets the same split. Within a
cluster, the cluster's train and test samples are split disjointly over its clients, so every
client is evaluated on samples of its own distribution.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fedcond.config import RunConfig
from fedcond.data.datasets import ArrayDataset, dataset_spec, load_dataset
from fedcond.data.drift import drift_partners
from fedcond.errors import FedcondError
from fedcond.fingerprint.fingerprints import check_fingerprint_for

MIN_TRAIN_SAMPLES_PER_CLIENT = 2
MIN_TEST_SAMPLES_PER_CLIENT = 1

# E2b's four rotation configurations in the paper (degrees, one cluster per angle).
ROTATION_CONFIGURATIONS = {
    "C1": (0.0, 180.0),
    "C2": (0.0, 120.0, 240.0),
    "C3": (0.0, 90.0, 180.0, 270.0),
    "C4": (0.0, 10.0, 180.0, 350.0),
}

# E3a: two clusters label the same images by different semantic groupings (two classes each).
SEMANTIC_GROUPINGS: dict[str, tuple[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]]] = {
    # MNIST digits: parity (label 1 = odd) vs magnitude (label 1 = 5..9).
    "mnist": (("odd/even", (0, 1, 0, 1, 0, 1, 0, 1, 0, 1)), ("below-5/above-5", (0, 0, 0, 0, 0, 1, 1, 1, 1, 1))),
    # Fashion-MNIST (t-shirt, trouser, pullover, dress, coat, sandal, shirt, sneaker, bag, ankle boot).
    # Formal (1): trouser, dress, coat, shirt, ankle boot; casual (0): t-shirt, pullover, sandal,
    # sneaker, bag. Winter (1): trouser, pullover, coat, ankle boot, and bag (season-neutral, put
    # here to balance 5/5); summer (0): t-shirt, dress, sandal, shirt, sneaker.
    "fashion-mnist": (
        ("formal/casual", (0, 1, 0, 1, 1, 0, 1, 0, 0, 1)),
        ("winter/summer", (0, 1, 1, 0, 1, 0, 0, 0, 1, 1)),
    ),
    # CIFAR-10 (airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck).
    # vehicle (0): airplane, automobile, ship, truck; domestic (1): cat, dog, horse; wild (2): bird,
    # deer, frog. By typical real-world size: large (0): airplane, ship, truck, horse; medium (1):
    # automobile, deer, dog; small (2): bird, cat, frog.
    "cifar10": (
        ("vehicle/domestic/wild", (0, 0, 2, 1, 2, 1, 2, 1, 0, 0)),
        ("large/medium/small", (0, 1, 2, 2, 1, 1, 2, 0, 0, 0)),
    ),
}  # fmt: skip

DOMAIN_SOURCES = ("mnist", "fashion-mnist")
# E4b: the most covariate clusters per concept group, one per subclass of its largest label.
MAX_COVARIATE_CLUSTERS = 4


@dataclass(frozen=True)
class ClientPartition:
    """One client's share: indices into its source dataset's train and test arrays, and its cluster.

    ``cluster`` is ground truth, used by Oracle and for reporting only; no method reads it to train.
    ``label_map`` maps the dataset's labels to the labels this client sees; ``rotation`` (degrees)
    is applied to its images; ``source`` names the dataset the indices refer to.
    """

    partition_id: int
    cluster: int
    train_indices: np.ndarray
    test_indices: np.ndarray
    label_map: np.ndarray
    source: str
    rotation: float = 0.0
    # A held-out client never trains; it evaluates the shared model with its own fingerprint.
    held_out: bool = False
    #: Indices into the source's train arrays held out of ``train_indices`` for choosing settings
    #: (``validation-fraction``): never trained on nor fingerprinted, scored every round.
    validation_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class Scenario:
    """The whole federation's layout: clusters, what each sees, and every client's partition."""

    name: str
    dataset: str
    num_classes: int
    cluster_descriptions: tuple[str, ...]
    clients: tuple[ClientPartition, ...]
    data_fraction: float = 1.0
    held_out_per_cluster: int = 0
    #: The dataset's class names by label (a per-class report's rows; under a label permutation a
    #: label's name is what it means to the dataset, not to every cluster).
    class_names: tuple[str, ...] = ()

    @property
    def num_clusters(self) -> int:
        return len(self.cluster_descriptions)

    def client(self, partition_id: int) -> ClientPartition:
        if not 0 <= partition_id < len(self.clients):
            raise FedcondError(
                f"partition-id {partition_id} is outside 0..{len(self.clients) - 1}; "
                "start as many nodes as num-clusters x (clients-per-cluster + held-out-clients)"
            )
        return self.clients[partition_id]

    def summary(self) -> dict[str, object]:
        """What a run prints before training and stores in ``run.json``."""
        train_sizes = [len(client.train_indices) for client in self.clients]
        validation_sizes = [len(client.validation_indices) for client in self.clients]
        test_sizes = [len(client.test_indices) for client in self.clients]
        held_out = self.held_out_per_cluster * self.num_clusters
        return {
            "scenario": self.name,
            "dataset": self.dataset,
            "num_clusters": self.num_clusters,
            "clients_per_cluster": (len(self.clients) - held_out) // self.num_clusters,
            "held_out_clients_per_cluster": self.held_out_per_cluster,
            "num_clients": len(self.clients),
            "num_classes": self.num_classes,
            "data_fraction": self.data_fraction,
            "clusters": list(self.cluster_descriptions),
            "train_samples_per_client": _min_median_max(train_sizes),
            "test_samples_per_client": _min_median_max(test_sizes),
            **({"validation_samples_per_client": _min_median_max(validation_sizes)} if any(validation_sizes) else {}),
        }


Loader = Callable[[str], ArrayDataset]


def format_summary(summary: dict[str, object]) -> str:
    """The scenario summary as a few readable lines (what a run prints before training)."""
    train, test = summary["train_samples_per_client"], summary["test_samples_per_client"]
    lines = [
        f"scenario {summary['scenario']} on {summary['dataset']}: {summary['num_clusters']} clusters x "
        f"{summary['clients_per_cluster']} clients, {summary['num_classes']} classes, "
        f"data-fraction {summary['data_fraction']}"
        + (
            f", plus {summary['held_out_clients_per_cluster']} held-out client(s) per cluster that never train"
            if summary.get("held_out_clients_per_cluster")
            else ""
        ),
        *(f"  cluster {k}: {description}" for k, description in enumerate(summary["clusters"])),
        f"  samples per client (min/median/max): train {train['min']}/{train['median']:g}/{train['max']}, "
        f"test {test['min']}/{test['median']:g}/{test['max']}",
    ]
    return "\n".join(lines)


def _min_median_max(values: list[int]) -> dict[str, float]:
    return {"min": min(values), "median": float(np.median(values)), "max": max(values)}


def _split_evenly(indices: np.ndarray, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle, then cut into ``parts`` disjoint pieces whose sizes differ by at most one."""
    return [np.sort(piece) for piece in np.array_split(rng.permutation(indices), parts)]


def _subsample(indices: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """A uniform ``fraction`` of ``indices`` (at least one), for quick runs on small machines."""
    if fraction >= 1.0:
        return indices
    keep = max(1, round(len(indices) * fraction))
    return np.sort(rng.choice(indices, size=keep, replace=False))


class _Builder:
    """Accumulates clients cluster by cluster, splitting each cluster's samples over its clients."""

    def __init__(self, config: RunConfig, load: Loader) -> None:
        self.config = config
        self.load = load
        self.rng = np.random.default_rng(config.seed)
        self.clients: list[ClientPartition] = []
        self.held_out: list[ClientPartition] = []
        self.descriptions: list[str] = []

    def add_cluster(
        self,
        description: str,
        train_pool: np.ndarray,
        test_pool: np.ndarray,
        label_map: np.ndarray,
        source: str,
        rotation: float = 0.0,
    ) -> None:
        cluster = len(self.descriptions)
        self.descriptions.append(description)
        train_pool = self._without_reserved(train_pool, source)
        fraction = self.config.data_fraction
        training = self.config.clients_per_cluster
        parts = training + self.config.held_out_clients
        train_parts = _split_evenly(_subsample(train_pool, fraction, self.rng), parts, self.rng)
        test_parts = _split_evenly(_subsample(test_pool, fraction, self.rng), parts, self.rng)
        for part, (train_indices, test_indices) in enumerate(zip(train_parts, test_parts, strict=True)):
            # Partition ids are assigned in scenario(): training clients first, then held-out ones.
            partition = ClientPartition(
                -1, cluster, train_indices, test_indices, label_map, source, rotation, held_out=part >= training
            )
            (self.held_out if partition.held_out else self.clients).append(partition)

    def add_partitioned(
        self, description: str, train_parts: list[np.ndarray], test_parts: list[np.ndarray], source: str, classes: int
    ) -> None:
        """One population already cut into clients (a partitioner's), training clients first: no clusters."""
        self.descriptions.append(description)
        training = self.config.clients_per_cluster
        for part, (train_indices, test_indices) in enumerate(zip(train_parts, test_parts, strict=True)):
            partition = ClientPartition(
                -1, 0, np.sort(train_indices), np.sort(test_indices), np.arange(classes), source,
                held_out=part >= training,
            )  # fmt: skip
            (self.held_out if partition.held_out else self.clients).append(partition)

    def _without_reserved(self, train_pool: np.ndarray, source: str) -> np.ndarray:
        """The pool minus the training images a ``<source>-reserved`` encoder learns from."""
        from fedcond.fingerprint.encoder import reserved_source, reserved_train_indices

        if reserved_source(self.config.fingerprint_encoder) != source:
            return train_pool
        return np.setdiff1d(train_pool, reserved_train_indices(self.load(source).train_y), assume_unique=True)

    def disjoint_shares(self, dataset: ArrayDataset) -> list[tuple[np.ndarray, np.ndarray]]:
        """All samples split into K disjoint shares: clusters that see the same distribution."""
        count = self.config.num_clusters
        train = _split_evenly(np.arange(len(dataset.train_y)), count, self.rng)
        test = _split_evenly(np.arange(len(dataset.test_y)), count, self.rng)
        return list(zip(train, test, strict=True))

    def scenario(self, name: str, dataset: str, num_classes: int) -> Scenario:
        # Training clients keep ids 0..N-1 whether or not there are held-out clients; held-out
        # clients follow, so a strategy tells them apart by partition id alone.
        clients = tuple(
            dataclasses.replace(partition, partition_id=index)
            for index, partition in enumerate([*self.clients, *self.held_out])
        )
        return Scenario(
            name,
            dataset,
            num_classes,
            tuple(self.descriptions),
            clients,
            self.config.data_fraction,
            self.config.held_out_clients,
        )


def label_shift(load: Loader, config: RunConfig) -> Scenario:
    """E1: K clusters receive disjoint, contiguous groups of the class list."""
    dataset = load(config.dataset)
    num_classes = dataset.num_classes
    if config.num_clusters > num_classes:
        raise FedcondError(
            f"label-shift needs num-clusters <= {num_classes} (the classes of {dataset.name}), "
            f"got {config.num_clusters}; lower num-clusters"
        )
    builder = _Builder(config, load)
    identity = np.arange(num_classes)
    for classes in _label_shift_groups(dataset, config.num_clusters):
        builder.add_cluster(
            "classes " + ",".join(dataset.class_names[c] for c in classes),
            np.flatnonzero(np.isin(dataset.train_y, classes)),
            np.flatnonzero(np.isin(dataset.test_y, classes)),
            identity,
            dataset.name,
        )
    return builder.scenario("label-shift", dataset.name, num_classes)


def _label_shift_groups(dataset: ArrayDataset, num_clusters: int) -> list[np.ndarray]:
    """Contiguous class groups; superclasses when K equals their count (CIFAR-10 K=2, CIFAR-100 K=20)."""
    if dataset.superclass_names and num_clusters == len(dataset.superclass_names):
        superclass_of = np.array(dataset.superclass_of)
        return [np.flatnonzero(superclass_of == k) for k in range(num_clusters)]
    return np.array_split(np.arange(dataset.num_classes), num_clusters)


def covariate_subclass(load: Loader, config: RunConfig) -> Scenario:
    """E2a: every cluster predicts the same superclasses but sees its own subclasses of each.

    Each superclass's subclasses are split into K contiguous groups; cluster k sees group k of
    every superclass (CIFAR-10, K=2: airplane, automobile / bird, cat, deer vs ship, truck / dog,
    frog, horse, all labelled vehicle or animal).
    """
    dataset = load(config.dataset)
    if not dataset.superclass_names:
        raise FedcondError(
            f"covariate-subclass needs superclasses (cifar10, cifar100), not {dataset.name}; change dataset"
        )
    superclass_of = np.array(dataset.superclass_of)
    members = [np.flatnonzero(superclass_of == k) for k in range(len(dataset.superclass_names))]
    smallest = min(len(group) for group in members)
    if not 2 <= config.num_clusters <= smallest:
        raise FedcondError(
            f"covariate-subclass on {dataset.name} takes num-clusters 2..{smallest} (got {config.num_clusters})"
        )
    builder = _Builder(config, load)
    for cluster in range(config.num_clusters):
        classes = np.concatenate([np.array_split(group, config.num_clusters)[cluster] for group in members])
        builder.add_cluster(
            "sees " + ",".join(dataset.class_names[c] for c in classes) + " as " + "/".join(dataset.superclass_names),
            np.flatnonzero(np.isin(dataset.train_y, classes)),
            np.flatnonzero(np.isin(dataset.test_y, classes)),
            superclass_of,
            dataset.name,
        )
    return builder.scenario("covariate-subclass", dataset.name, len(dataset.superclass_names))


def combined(load: Loader, config: RunConfig) -> Scenario:
    """E4b: two concept groups (CIFAR-10's vehicle/domestic/wild vs large/medium/small labellings),
    each split into C covariate clusters that see different subclasses of every label: 2*C clusters.

    Each label's subclasses are cut into C contiguous groups (``numpy.array_split``). A label has 3
    or 4 subclasses, so at C = 4 the fourth cluster of each group gets no subclass of its 3-subclass
    labels and sees one class only (truck, in both groups: the last subclass of vehicle and of large). The paper runs
    C = 4 without saying how it splits 3 subclasses 4 ways; this is our reading of it.
    """
    if config.dataset != "cifar10":
        raise FedcondError(f"combined is defined on cifar10, not {config.dataset}; set dataset=cifar10")
    covariate = config.covariate_clusters
    if config.num_clusters != 2 * covariate:
        raise FedcondError(
            f"combined has 2 x covariate-clusters = {2 * covariate} clusters; set num-clusters={2 * covariate}"
        )
    if not 1 <= covariate <= MAX_COVARIATE_CLUSTERS:
        raise FedcondError(
            f"combined takes covariate-clusters 1..{MAX_COVARIATE_CLUSTERS} (no label has more subclasses), "
            f"got {covariate}"
        )
    dataset = load(config.dataset)
    builder = _Builder(config, load)
    halves = RunConfig(num_clusters=2, seed=config.seed)
    shares = _Builder(halves, load).disjoint_shares(dataset)
    for (name, mapping), (train, test) in zip(SEMANTIC_GROUPINGS["cifar10"], shares, strict=True):
        label_map = np.array(mapping)
        members = [np.flatnonzero(label_map == label) for label in range(label_map.max() + 1)]
        for part in range(covariate):
            classes = np.concatenate([np.array_split(group, covariate)[part] for group in members])
            builder.add_cluster(
                f"labels {name}, sees " + ",".join(dataset.class_names[c] for c in classes),
                train[np.isin(dataset.train_y[train], classes)],
                test[np.isin(dataset.test_y[test], classes)],
                label_map,
                dataset.name,
            )
    return builder.scenario("combined", dataset.name, 3)


def parse_rotations(text: str, num_clusters: int) -> tuple[float, ...]:
    """``C1``..``C4``, a comma-separated list of degrees, or empty for K evenly spaced angles."""
    text = text.strip()
    if not text:
        angles = tuple(360.0 * k / num_clusters for k in range(num_clusters))
    elif text.upper() in ROTATION_CONFIGURATIONS:
        angles = ROTATION_CONFIGURATIONS[text.upper()]
    else:
        try:
            angles = tuple(float(part) for part in text.split(","))
        except ValueError:
            raise FedcondError(
                f"rotations must be C1..C4 or comma-separated degrees like 0,90,180 (got '{text}')"
            ) from None
    if len(angles) != num_clusters:
        raise FedcondError(
            f"rotations '{text}' gives {len(angles)} angles but num-clusters is {num_clusters}; "
            f"set num-clusters={len(angles)}"
        )
    return angles


def covariate_rotation(load: Loader, config: RunConfig) -> Scenario:
    """E2b: all clusters see the same classes; each cluster's images are rotated by its own angle."""
    dataset = load(config.dataset)
    angles = parse_rotations(config.rotations, config.num_clusters)
    builder = _Builder(config, load)
    identity = np.arange(dataset.num_classes)
    for angle, (train, test) in zip(angles, builder.disjoint_shares(dataset), strict=True):
        builder.add_cluster(f"rotated {angle:g} degrees", train, test, identity, dataset.name, angle)
    return builder.scenario("covariate-rotation", dataset.name, dataset.num_classes)


def concept_permutation(load: Loader, config: RunConfig) -> Scenario:
    """E3b: the same kind of images in every cluster, each cluster with its own seeded label permutation."""
    if not 2 <= config.num_clusters <= 5:
        raise FedcondError(f"concept-permutation takes num-clusters 2..5 (got {config.num_clusters})")
    dataset = load(config.dataset)
    builder = _Builder(config, load)
    permutations = np.random.default_rng([config.seed, 3]).permuted(
        np.tile(np.arange(dataset.num_classes), (config.num_clusters, 1)), axis=1
    )
    for permutation, (train, test) in zip(permutations, builder.disjoint_shares(dataset), strict=True):
        builder.add_cluster(
            "labels permuted " + ",".join(map(str, permutation)), train, test, permutation, dataset.name
        )
    return builder.scenario("concept-permutation", dataset.name, dataset.num_classes)


def concept_semantic(load: Loader, config: RunConfig) -> Scenario:
    """E3a: two clusters label the same kind of images by two different semantic groupings."""
    if config.dataset not in SEMANTIC_GROUPINGS:
        raise FedcondError(
            f"concept-semantic is defined for {', '.join(SEMANTIC_GROUPINGS)}, not {config.dataset}; change dataset"
        )
    if config.num_clusters != 2:
        raise FedcondError(f"concept-semantic has exactly 2 clusters; set num-clusters=2 (got {config.num_clusters})")
    dataset = load(config.dataset)
    builder = _Builder(config, load)
    groupings = SEMANTIC_GROUPINGS[config.dataset]
    for (name, mapping), (train, test) in zip(groupings, builder.disjoint_shares(dataset), strict=True):
        builder.add_cluster(f"labels {name}", train, test, np.array(mapping), dataset.name)
    return builder.scenario("concept-semantic", dataset.name, max(max(m) for _, m in groupings) + 1)


def domain(load: Loader, config: RunConfig) -> Scenario:
    """E4a: MNIST clients and Fashion-MNIST clients together, both with their own 10 classes."""
    if config.dataset not in DOMAIN_SOURCES:
        raise FedcondError(f"domain pairs MNIST with Fashion-MNIST; set dataset to one of {', '.join(DOMAIN_SOURCES)}")
    if config.num_clusters != 2:
        raise FedcondError("domain has exactly 2 clusters (MNIST, Fashion-MNIST); set num-clusters=2")
    builder = _Builder(config, load)
    for source in DOMAIN_SOURCES:
        dataset = load(source)
        identity = np.arange(dataset.num_classes)
        train, test = np.arange(len(dataset.train_y)), np.arange(len(dataset.test_y))
        builder.add_cluster(f"{source} images", train, test, identity, source)
    return builder.scenario("domain", "mnist+fashion-mnist", 10)


def concept_weights(load: Loader, config: RunConfig) -> Scenario:
    """The appendix's tabular concept shift: cluster k holds the samples of concept k, the same
    Gaussian features labelled through its own weight vector w_k (``fedcond.data.tabular``)."""
    from fedcond.data.tabular import CONCEPTS

    if not 1 <= config.num_clusters <= CONCEPTS:
        raise FedcondError(
            f"concept-weights has {CONCEPTS} concepts; set num-clusters to 1..{CONCEPTS} (got {config.num_clusters})"
        )
    dataset = load(config.dataset)
    builder = _Builder(config, load)
    identity = np.arange(dataset.num_classes)
    for concept in range(config.num_clusters):
        builder.add_cluster(
            f"labelled by concept {concept}'s weights",
            np.flatnonzero(dataset.train_concepts == concept),
            np.flatnonzero(dataset.test_concepts == concept),
            identity,
            dataset.name,
        )
    return builder.scenario("concept-weights", dataset.name, dataset.num_classes)


def _label_partitions(config: RunConfig, labels: np.ndarray, count: int) -> list[np.ndarray]:
    """``count`` disjoint client shares of the training samples by flwr-datasets' partitioner for the
    scenario (Dirichlet label skew, or k classes per client), run on the labels as a local table."""
    import warnings

    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, PathologicalPartitioner

    table = Dataset.from_dict({"label": labels, "index": np.arange(len(labels))})
    if config.scenario == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=count, partition_by="label", alpha=config.dirichlet_alpha,
            min_partition_size=MIN_TRAIN_SAMPLES_PER_CLIENT, self_balancing=False, seed=config.seed,
        )  # fmt: skip
    else:
        partitioner = PathologicalPartitioner(
            num_partitions=count, partition_by="label", num_classes_per_partition=config.classes_per_client,
            class_assignment_mode="deterministic", seed=config.seed,
        )  # fmt: skip
    partitioner.dataset = table
    with warnings.catch_warnings():  # its redraws until every share is large enough are not the user's concern
        warnings.simplefilter("ignore", UserWarning)
        return [np.asarray(partitioner.load_partition(part)["index"], dtype=np.int64) for part in range(count)]


def _matching_test_shares(
    train_labels: list[np.ndarray], test_pool: np.ndarray, test_labels: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Disjoint test shares with each client's training label mix: every class's test samples are cut
    among the clients in proportion to how many of that class each holds for training."""
    shares: list[list[np.ndarray]] = [[] for _ in train_labels]
    for label in np.unique(test_labels[test_pool]):
        pool = rng.permutation(test_pool[test_labels[test_pool] == label])
        held = np.array([np.sum(labels == label) for labels in train_labels], dtype=np.float64)
        if held.sum() == 0:
            continue
        counts = np.floor(held / held.sum() * len(pool)).astype(int)
        for index in np.argsort(-(held / held.sum() * len(pool) - counts))[: len(pool) - counts.sum()]:
            counts[index] += 1  # largest remainders: every test sample of the class goes to someone who has it
        for client, piece in enumerate(np.split(pool, np.cumsum(counts)[:-1])):
            shares[client].append(piece)
    return [np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64) for pieces in shares]


def check_unclustered(config: RunConfig) -> None:
    """A partition without clusters takes one population: num-clusters 1 (before any data is read)."""
    if not scenario_kind(config.scenario).clustered and config.num_clusters != 1:
        raise FedcondError(
            f"{config.scenario} has no clusters (one population, each client's labels drawn by the partitioner): "
            f"set num-clusters=1 and clients-per-cluster to the number of clients (got num-clusters="
            f"{config.num_clusters})"
        )
    classes = dataset_spec(config.dataset).num_classes
    if config.scenario == "pathological" and config.classes_per_client > classes:
        raise FedcondError(
            f"classes-per-client={config.classes_per_client} is more than the {classes} classes of "
            f"{config.dataset}; lower it"
        )


def label_partitioned(load: Loader, config: RunConfig) -> Scenario:
    """No clusters: every client's label mix drawn by the field's partitioners (flwr-datasets) from
    one population. ``dirichlet``: each client's label proportions ~ Dir(``dirichlet-alpha``);
    ``pathological``: ``classes-per-client`` classes each (assigned in turn, McMahan et al.'s split).
    Held-out clients are drawn the same way. Test data follows each client's training label mix."""
    check_unclustered(config)
    dataset = load(config.dataset)
    builder = _Builder(config, load)
    train_pool = _subsample(builder._without_reserved(np.arange(len(dataset.train_y)), dataset.name),
                            config.data_fraction, builder.rng)  # fmt: skip
    test_pool = _subsample(np.arange(len(dataset.test_y)), config.data_fraction, builder.rng)
    count = config.clients_per_cluster + config.held_out_clients
    train_parts = [train_pool[share] for share in _label_partitions(config, dataset.train_y[train_pool], count)]
    test_parts = _matching_test_shares([dataset.train_y[part] for part in train_parts], test_pool, dataset.test_y,
                                       builder.rng)  # fmt: skip
    described = (f"Dirichlet label skew, alpha {config.dirichlet_alpha:g}" if config.scenario == "dirichlet"
                 else f"{config.classes_per_client} classes per client")  # fmt: skip
    builder.add_partitioned(f"no clusters: {described}", train_parts, test_parts, dataset.name, dataset.num_classes)
    return builder.scenario(config.scenario, dataset.name, dataset.num_classes)


@dataclass(frozen=True)
class ScenarioKind:
    """One scenario of the table: how it splits the data, and what its clusters are (the checks that
    refuse a method, a fingerprint or a drift a scenario cannot serve read these, nothing else)."""

    build: Callable[[Loader, RunConfig], Scenario]
    #: False: one population cut by a partitioner, no true clusters: nothing for Oracle or a
    #: cluster-id control to be told, no other cluster for a client to drift to.
    clustered: bool = True
    #: True: every cluster holds the same images and the clusters differ only in their labels, so a
    #: fingerprint that reads no labels is the same, in distribution, for each of them.
    labels_only: bool = False
    #: True: it splits a tabular task (``DatasetSpec.tabular``), and only those; False: images only.
    tabular: bool = False


SCENARIOS: dict[str, ScenarioKind] = {
    "label-shift": ScenarioKind(label_shift),
    "covariate-subclass": ScenarioKind(covariate_subclass),
    "covariate-rotation": ScenarioKind(covariate_rotation),
    "concept-semantic": ScenarioKind(concept_semantic),
    "concept-permutation": ScenarioKind(concept_permutation, labels_only=True),
    "domain": ScenarioKind(domain),
    "combined": ScenarioKind(combined),
    "dirichlet": ScenarioKind(label_partitioned, clustered=False),
    "pathological": ScenarioKind(label_partitioned, clustered=False),
    "concept-weights": ScenarioKind(concept_weights, labels_only=True, tabular=True),
}
#: The scenarios without true clusters (from the table).
UNCLUSTERED_SCENARIOS = tuple(name for name, kind in SCENARIOS.items() if not kind.clustered)


def scenario_kind(name: str) -> ScenarioKind:
    """The table's entry for ``name``, or a one-line error listing the scenarios."""
    if name not in SCENARIOS:
        raise FedcondError(f"unknown scenario '{name}'; choose one of {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def build_scenario(config: RunConfig, load: Loader | None = None) -> Scenario:
    """Split the data as ``config.scenario`` says, checking every client gets enough of it."""
    data_dir = config.resolved_data_dir()
    load = load or (lambda name: load_dataset(name, data_dir))
    scenario = scenario_kind(config.scenario).build(load, config)
    names = load(config.dataset).class_names
    if len(names) == scenario.num_classes:
        scenario = dataclasses.replace(scenario, class_names=tuple(names))
    if config.validation_fraction:
        scenario = with_validation(scenario, config.validation_fraction, config.seed, load)
    for client in scenario.clients:
        too_few_train = len(client.train_indices) < MIN_TRAIN_SAMPLES_PER_CLIENT
        if too_few_train or len(client.test_indices) < MIN_TEST_SAMPLES_PER_CLIENT:
            raise FedcondError(
                f"client {client.partition_id} gets {len(client.train_indices)} training and "
                f"{len(client.test_indices)} test samples; lower clients-per-cluster (or held-out-clients) "
                "or raise data-fraction"
            )
    return scenario


def validation_split(
    indices: np.ndarray, labels: np.ndarray | None, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``indices`` cut into (training, validation): ``fraction`` of each class held out, rounded to the
    nearest sample (a class of one sample stays in training), the samples drawn by ``rng``; without
    ``labels`` (a regression task's real-valued targets) a uniform ``fraction``. Both parts sorted."""
    groups = [np.arange(len(indices))] if labels is None else [np.flatnonzero(labels == c) for c in np.unique(labels)]
    held = [rng.permutation(group)[: round(len(group) * fraction)] for group in groups]
    chosen = np.zeros(len(indices), dtype=bool)
    chosen[np.concatenate(held).astype(np.int64)] = True
    return np.sort(indices[~chosen]), np.sort(indices[chosen])


def with_validation(scenario: Scenario, fraction: float, seed: int, load: Loader) -> Scenario:
    """Every client's training indices less a seeded, class-stratified ``fraction`` (``validation-fraction``).

    Cut after the split, with a generator of its own per client: every client holds the same training and
    test samples as without validation, less its validation ones, so that a run with validation and one
    without differ in that alone."""
    clients = []
    for client in scenario.clients:
        targets = load(client.source).train_y[client.train_indices]
        labels = None if np.issubdtype(targets.dtype, np.floating) else targets
        rng = np.random.default_rng([seed, client.partition_id, VALIDATION_STREAM])
        train, validation = validation_split(client.train_indices, labels, fraction, rng)
        if len(validation) == 0:
            raise FedcondError(
                f"validation-fraction={fraction} holds out no sample of client {client.partition_id}'s "
                f"{len(client.train_indices)}; raise validation-fraction or data-fraction"
            )
        clients.append(dataclasses.replace(client, train_indices=train, validation_indices=validation))
    return dataclasses.replace(scenario, clients=tuple(clients))


#: Keeps the validation generator's stream apart from any other seeded by (seed, partition id).
VALIDATION_STREAM = 0x7A11D


def validate_without_data(config: RunConfig) -> None:
    """Every check that needs no data files: cheap enough for any entry point to run first."""
    from fedcond.fingerprint.encoder import check_encoder
    from fedcond.model.conditioning import check_conditioning_for
    from fedcond.records.metrics import PER_CLASS_ACCURACY

    spec = dataset_spec(config.dataset)
    kind = scenario_kind(config.scenario)
    if kind.tabular != spec.tabular:
        matching = ", ".join(name for name, other in SCENARIOS.items() if other.tabular == spec.tabular)
        raise FedcondError(
            f"scenario {config.scenario} splits {'tabular tasks' if kind.tabular else 'images'}, and {config.dataset} "
            f"{'is a tabular task' if spec.tabular else 'holds images'}; choose a scenario of {matching}"
        )
    check_conditioning_for(config.conditioning, "tabular" if spec.tabular else "cnn", config.dataset)
    check_fingerprint_for(
        config.fingerprint, config.fingerprint_dim, config.dataset, config.fingerprint_encoder, config.normalisation
    )
    check_unclustered(config)
    if config.drift_fraction and (config.num_clusters < 2 or not kind.clustered):
        raise FedcondError(
            "drift-fraction moves clients to another cluster's distribution: it needs 2 clusters or more "
            f"(num-clusters={config.num_clusters}, scenario {config.scenario})"
        )
    held = DOMAIN_SOURCES if config.scenario == "domain" else (config.dataset,)
    check_encoder(config.fingerprint_encoder, held)
    if spec.regression and PER_CLASS_ACCURACY.of(config):
        raise FedcondError(
            f"per-class-accuracy scores classes, and {config.dataset} is a regression task (RMSE); leave it off"
        )


# The settings that decide which samples each client holds: they key ``scenario_for``'s cache, and a
# partition file records them so that a client never trains on a split the run did not ask for.
SPLIT_KEYS = (
    "dataset",
    "scenario",
    "num-clusters",
    "clients-per-cluster",
    "held-out-clients",
    "seed",
    "rotations",
    "data-fraction",
    "covariate-clusters",
)

#: The partitioners' own settings: they decide the split of their scenarios only (and so only those
#: scenarios' partition files record them).
PARTITIONER_KEYS = {"dirichlet": ("dirichlet-alpha",), "pathological": ("classes-per-client",)}


def split_settings(config: RunConfig) -> dict[str, object]:
    """``config``'s values of ``SPLIT_KEYS``, and its encoder where that holds images back from the
    clients (only then: partition files of every other split keep the keys they were written with)."""
    from fedcond.fingerprint.encoder import reserved_source

    mapping = config.to_mapping()
    split = {key: mapping[key] for key in SPLIT_KEYS}
    split.update({key: mapping[key] for key in PARTITIONER_KEYS.get(config.scenario, ())})
    if reserved_source(config.fingerprint_encoder):
        split["fingerprint-encoder"] = config.fingerprint_encoder
    if config.validation_fraction:  # only then: partition files of every other split keep their keys
        split["validation-fraction"] = config.validation_fraction
    return split


@functools.lru_cache(maxsize=8)
def _cached_scenario(config: RunConfig) -> Scenario:
    return build_scenario(config)


def forget_loaded_data() -> None:
    """Drop this process's decoded datasets and scenarios (MNIST: ~0.2 GB): for a process that
    checked a run and now only waits for Flower's processes, which load their own."""
    from fedcond.data.datasets import load_dataset

    _cached_scenario.cache_clear()
    load_dataset.cache_clear()


def drift_partners_of(config: RunConfig) -> dict[int, int]:
    """Drifting training client -> whose data it holds from ``drift-round`` on (``fedcond.data.drift``)."""
    if not config.drift_fraction:
        return {}
    scenario = scenario_for(config)
    clusters = tuple(client.cluster for client in scenario.clients[: config.num_training_clients])
    return drift_partners(config.seed, config.drift_fraction, clusters, scenario.num_clusters)


def scenario_for(config: RunConfig) -> Scenario:
    """The scenario of a run, built once per process (a Ray actor serves many clients)."""
    # Only the split settings (and where the files are) key the cache, so rounds and methods share it.
    split = {key.replace("-", "_"): value for key, value in split_settings(config).items()}
    return _cached_scenario(RunConfig(**split, data_dir=str(config.resolved_data_dir() or "")))
