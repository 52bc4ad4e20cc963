"""Aggregating what clients report in a round into the round's numbers."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ClientEvaluation:
    """One client's evaluation of the model it would actually use, on its own test set."""

    cluster: int
    num_samples: int
    loss: float
    accuracy: float


def weighted_mean(pairs: Iterable[tuple[float, int]]) -> float:
    """Sample-weighted mean of (value, weight) pairs; NaN when there is no weight."""
    total = weight = 0.0
    for value, count in pairs:
        total += value * count
        weight += count
    return total / weight if weight else math.nan


def summarise_evaluations(evaluations: list[ClientEvaluation]) -> tuple[float, float, dict[int, float]]:
    """Mean local-test accuracy and loss (weighted by test samples) and accuracy per cluster."""
    accuracy = weighted_mean((e.accuracy, e.num_samples) for e in evaluations)
    loss = weighted_mean((e.loss, e.num_samples) for e in evaluations)
    by_cluster: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for e in evaluations:
        by_cluster[e.cluster].append((e.accuracy, e.num_samples))
    return accuracy, loss, {cluster: weighted_mean(pairs) for cluster, pairs in sorted(by_cluster.items())}
