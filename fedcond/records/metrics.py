"""Aggregating what clients report in a round into the round's numbers."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from fedcond.config import Option

#: Scores where lower is better (a regression task's RMSE): the worst client is the highest.
LOWER_IS_BETTER = frozenset({"rmse"})

PER_CLASS_ACCURACY = Option(
    "per-class-accuracy", False,
    "also score every class in the final round (run.json: final_class_accuracy); each client's evaluate reply "
    "then carries its test set's count and correct count per class, so its test label histogram reaches the server",
)  # fmt: skip


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


@dataclass(frozen=True)
class Spread:
    """How a round's accuracy is spread over its clients, each client counting once whatever its
    test set's size: the clients a personalised method exists for are the ones a mean hides."""

    worst: float
    p10: float
    std: float

    @classmethod
    def of(cls, evaluations: list[ClientEvaluation], metric: str = "accuracy") -> Spread:
        """The worst client's score, the 10th percentile from the worst end (linear interpolation)
        and the standard deviation over clients (NaN for no clients). Worst is lowest, except for a
        score where lower is better (RMSE: the highest, and the 90th percentile)."""
        if not evaluations:
            return cls(math.nan, math.nan, math.nan)
        scores = np.array([e.accuracy for e in evaluations], dtype=np.float64)
        if metric in LOWER_IS_BETTER:
            return cls(float(scores.max()), float(np.percentile(scores, 90)), float(scores.std()))
        return cls(float(scores.min()), float(np.percentile(scores, 10)), float(scores.std()))

    def as_fields(self, prefix: str = "") -> dict[str, float]:
        """As a round record's fields (``fedcond.records.history.RoundRecord``): ``heldout_`` for the newcomers'."""
        return {
            f"{prefix}worst_accuracy": self.worst,
            f"{prefix}p10_accuracy": self.p10,
            f"{prefix}accuracy_std": self.std,
        }


def class_accuracy(
    counts: Iterable[tuple[np.ndarray, np.ndarray]], class_names: Sequence[str]
) -> dict[str, dict[str, float | int | None]]:
    """Per class, over the clients' (correct, count) arrays: the accuracy on all their test samples of
    that class (None where none holds one) and the number of samples."""
    correct = total = None
    for hits, count in counts:
        correct = hits if correct is None else correct + hits
        total = count if total is None else total + count
    if correct is None or total is None:
        return {}
    names = list(class_names) if len(class_names) == len(total) else [str(index) for index in range(len(total))]
    return {
        name: {"accuracy": float(c / n) if n else None, "samples": int(n)}
        for name, c, n in zip(names, correct, total, strict=True)
    }
