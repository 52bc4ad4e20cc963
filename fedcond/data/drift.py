"""Drifting clients: a fraction of the training clients move to another cluster's distribution.

With ``drift-fraction`` f and ``drift-round`` D, round(f x training clients) of them, drawn by a
generator seeded with the run's seed, hold from round D on (their training in round D and every
evaluation of round D's model and later) the data of a *partner*: the training client with the same
index within the next cluster (cluster c moves to c + 1 mod K). They keep their partition id, and
so their name and state: what each method does about it is its own rule (docs/newcomers.md):
Conditional recomputes its fingerprint on the new data (``drift-fingerprint = "recompute"``) or
keeps the stale one, IFCA re-selects by its losses, Ditto and Local keep their personal models,
Oracle is told (it serves the new cluster's model from round D). Sharing the partner's samples keeps
every other client's split unchanged; the partner's data then counts twice in a FedAvg mean.

A drift run sends its two messages a round (an evaluate message scores each round's model on the
data the clients hold in that round; ``evaluate-in-fit`` would score round D-1's model inside round
D's message, when the drifted clients already hold the new data). ``drifted_accuracy`` in
``history.csv`` is the drifting clients' sample-weighted accuracy every round, before and after D.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from fedcond.errors import FedcondError

#: Keeps the drift's generator apart from every other generator seeded by the run's seed.
DRIFT_STREAM = 0xD21F7
DRIFT_FINGERPRINTS = ("recompute", "stale")


@functools.lru_cache(maxsize=16)
def drift_partners(seed: int, fraction: float, clusters: tuple[int, ...], num_clusters: int) -> dict[int, int]:
    """Drifting training client -> the partner whose data it holds from the drift round on.

    ``clusters`` are the training clients' true clusters, by partition id."""
    if fraction <= 0:
        return {}
    members: dict[int, list[int]] = {cluster: [] for cluster in range(num_clusters)}
    for partition, cluster in enumerate(clusters):
        members[cluster].append(partition)
    count = round(fraction * len(clusters))
    rng = np.random.default_rng([seed, DRIFT_STREAM])
    movers = sorted(int(pid) for pid in rng.choice(len(clusters), size=count, replace=False))
    partners = {}
    for pid in movers:
        cluster = clusters[pid]
        target = members[(cluster + 1) % num_clusters]
        partners[pid] = target[members[cluster].index(pid) % len(target)]
    return partners


def check_drift(fraction: float, drift_round: int, num_rounds: int, fingerprint_rule: str) -> None:
    """The drift settings on their own, in one line each."""
    if not 0 <= fraction <= 1:
        raise FedcondError(f"drift-fraction must be in [0, 1] (got {fraction})")
    if drift_round > num_rounds:
        raise FedcondError(
            f"drift-round={drift_round} is past the last round ({num_rounds}); give a round in 1..{num_rounds}"
        )
    if (fraction > 0) != (drift_round > 0):
        raise FedcondError(
            "drift-fraction and drift-round go together: give both (a fraction above 0 and a round from 1), or neither"
        )
    if fingerprint_rule not in DRIFT_FINGERPRINTS:
        raise FedcondError(
            f"unknown drift-fingerprint '{fingerprint_rule}'; choose one of {', '.join(DRIFT_FINGERPRINTS)}"
        )


def cluster_at(partition: int, server_round: int, drift_round: int, partners: dict[int, int],
               clusters: Sequence[int]) -> int:  # fmt: skip
    """The cluster whose distribution ``partition`` holds in ``server_round``."""
    if drift_round and server_round >= drift_round and partition in partners:
        return clusters[partners[partition]]
    return clusters[partition]
