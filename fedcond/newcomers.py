"""Newcomers: clients that never train and are served a model by their method's rule.

A held-out client (``held-out-clients`` per cluster) stands for a client that joins after training:
each round it scores, on its own test data, the model its method would give it, untouched (zero-shot:
``heldout_accuracy``), and with ``newcomer-steps = k`` also that model after k SGD steps on its own
training data (``heldout_adapted_accuracy``), the same k for every method so that the comparison is
fair. Each method's rule (docs/newcomers.md): FedAvg, FedProx and Ditto the global model, Conditional the
global model fed the newcomer's own fingerprint, Oracle its true cluster's model, IFCA the cluster
model with the lowest loss on the newcomer's training data, Local a model of its own (untrained:
only the k steps teach it), Gossip a random training client's model (its one random peer), DAC the
uniform average of the ``dac-neighbours`` training clients' models with the lowest loss on the
newcomer's training data (DAC's similarity for a client with no model of its own to compare),
descriptor clustering the model of the cluster nearest the descriptor it sends before round 1, CFL
the leaf of the parameter tree its own updates lead it to (``fedcond.model.parameter_tree``), pFedHN the
mean embedding's model and, with ``newcomer-steps``, that of an embedding it learns in as many
exchanges with the hypernetwork frozen (``fedcond.strategies.pfedhn``: its k steps are embedding steps).
"""

from __future__ import annotations

import numpy as np

from fedcond.config import Option
from fedcond.errors import FedcondError

NEWCOMER_STEPS = Option(
    "newcomer-steps",
    0,
    "held-out clients: also score the model their method serves them after this many SGD steps on their own "
    "training data (heldout_adapted_accuracy); 0 = zero-shot only",
    minimum=0,
)
NEWCOMER_FINGERPRINT = Option(
    "newcomer-fingerprint",
    "own",
    "conditioned methods' held-out clients: `own` (the method) or `other-concept`, an ablation that can fail: "
    "each newcomer is fed the fingerprint of a training client of another concept (combined: the other concept "
    "group's cluster of the same subclasses; other clustered scenarios: the next cluster), scored on its own test "
    "data; a model that ignores the fingerprint scores the same",
)
NEWCOMER_FINGERPRINTS = ("own", "other-concept")


def mismatched_participant(clusters: tuple[int, ...], num_training: int, newcomer: int, partner_cluster: int) -> int:
    """The first training client of ``partner_cluster`` (``clusters``: every partition's true cluster), whose
    fingerprint ``newcomer-fingerprint = other-concept`` feeds newcomer ``newcomer``."""
    for partition in range(num_training):
        if clusters[partition] == partner_cluster:
            return partition
    raise FedcondError(
        f"newcomer-fingerprint=other-concept: no training client in cluster {partner_cluster} for newcomer "
        f"{newcomer}; give every cluster clients-per-cluster=1 or more"
    )


def other_concept_cluster(cluster: int, num_clusters: int, scenario: str, covariate_clusters: int) -> int:
    """The cluster of another concept: in ``combined`` (two concept groups of C covariate clusters each,
    group-major) the other group's cluster of the same subclasses, so that only the concept differs;
    elsewhere the next cluster."""
    if scenario == "combined":
        return (cluster + covariate_clusters) % num_clusters
    return (cluster + 1) % num_clusters


#: Keeps the newcomers' generators apart from every other generator seeded by (seed, round, ...).
NEWCOMER_STREAM = 0x4E3C0


def step_indices(num_samples: int, steps: int, batch_size: int, seed: int) -> np.ndarray:
    """The samples of ``steps`` batches of ``batch_size``: seeded passes over the training set, one after
    another, so that one epoch over them is exactly ``steps`` SGD steps."""
    rng = np.random.default_rng([seed, NEWCOMER_STREAM])
    passes = -(-steps * batch_size // num_samples)
    return np.concatenate([rng.permutation(num_samples) for _ in range(passes)])[: steps * batch_size]


def random_peer(seed: int, server_round: int, newcomer: int, peers: int) -> int:
    """Gossip's rule for a newcomer: one training client drawn at random, anew each round."""
    return int(np.random.default_rng([seed, server_round, newcomer, NEWCOMER_STREAM]).integers(peers))


def lowest_loss_average(models: list[list[np.ndarray]], losses: list[float], count: int) -> list[np.ndarray]:
    """The uniform average of the ``count`` models with the lowest losses (ties: the earlier model)."""
    chosen = sorted(range(len(models)), key=lambda index: (losses[index], index))[:count]
    return [np.mean([models[index][layer] for index in chosen], axis=0).astype(models[chosen[0]][layer].dtype)
            for layer in range(len(models[0]))]  # fmt: skip
