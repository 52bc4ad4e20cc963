"""CFL's parameter tree (Sattler, Müller and Samek, IEEE TNNLS 2020, the section "Varying client
populations and parameter trees"): how a client that joins after clusters have split is placed in
one, with no K and no labels of the clusters.

Every split the server makes is a node of the tree: the model the split cluster's clients trained
from that round (the pre-split model θ*) and, for each of the two sides, the mean of its clients'
unit update directions. A newcomer starts at the root cluster and, at each split of the cluster it
is in (in the order the splits happened), trains the split's θ* on its own data as in a round,
computes its own update Δ = θ~ - θ*, and moves to the side its update points with: the larger
mean cosine similarity with that side's clients' updates, (Δ / ||Δ||) · mean_i(Δ_i / ||Δ_i||), the
paper's similarity averaged over the branch. One local training per level of the tree; a leaf is
the cluster whose model the newcomer is then served.

Where fedcond deviates, and why: the paper's server caches the clients' updates of each split and
moves a newcomer to the branch whose cached updates its own is most similar to; the mean unit
direction per side gives the mean of those similarities exactly and keeps the message to three
models per split, whatever the number of clients.

A message to a newcomer carries the leaves' current models, then per split θ* and the two sides'
directions (flat float32 arrays), with the tree's shape in the round's settings (``header``). Core
code: no Flower (``fedcond.strategies.cfl`` keeps the tree, ``fedcond.clients.cfl`` walks it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fedcond.errors import FedcondError
from fedcond.model.aggregation import trained_vector

Model = list[np.ndarray]
STAYED, MOVED = 0, 1


@dataclass
class Split:
    """One node of the tree: ``cluster`` was cut at its model ``model``; the clients of side 1 became
    ``new_cluster``. ``directions[s]``: the mean of side s's clients' unit update directions."""

    cluster: int
    new_cluster: int
    model: Model
    directions: tuple[np.ndarray, np.ndarray]


def weight_update(after: Model, before: Model, trained: Sequence[bool]) -> np.ndarray:
    """The flattened change of the trained weights from ``before`` to ``after`` (``trained``: per
    array, ``fedcond.model.networks.trained_arrays``), the update CFL compares; buffers are left out
    (``fedcond.model.aggregation.trained_vector`` says why)."""
    return trained_vector(after, trained) - trained_vector(before, trained)


def side_directions(updates: np.ndarray, sides: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean unit update of each side (rows of ``updates`` labelled 0 or 1 by ``sides``)."""
    unit = updates / np.maximum(np.linalg.norm(updates, axis=1, keepdims=True), 1e-12)
    return tuple(unit[sides == side].mean(axis=0).astype(np.float32) for side in (STAYED, MOVED))  # type: ignore[return-value]


def side_for(update: np.ndarray, split: Split) -> int:
    """The side whose clients' updates ``update`` is on average most similar to (ties: the side that stayed)."""
    unit = np.asarray(update, np.float64) / max(float(np.linalg.norm(update)), 1e-12)
    stayed, moved = (float(unit @ direction) for direction in split.directions)
    return MOVED if moved > stayed else STAYED


def walk(splits: Sequence[Split], update_at: Callable[[Model], np.ndarray]) -> tuple[int, list[int]]:
    """The leaf cluster a newcomer reaches from the root (cluster 0), and the side it took at each split
    on its way; ``update_at(model)`` is the newcomer's flattened update after training ``model``."""
    cluster, path = 0, []
    for split in splits:  # in the order they happened: a cluster's later splits come after its creation
        if split.cluster != cluster:
            continue
        side = side_for(update_at(split.model), split)
        path.append(side)
        if side == MOVED:
            cluster = split.new_cluster
    return cluster, path


def pack(leaves: Sequence[Model], splits: Sequence[Split]) -> list[np.ndarray]:
    """The arrays of a newcomer's message: the leaves' models, then each split's model and directions."""
    arrays = [array for model in leaves for array in model]
    for split in splits:
        arrays += [*split.model, *split.directions]
    return arrays


def header(num_leaves: int, splits: Sequence[Split]) -> str:
    """What says how to read ``pack``'s arrays back: the number of leaves and each split's two clusters."""
    return json.dumps({"leaves": num_leaves, "splits": [[split.cluster, split.new_cluster] for split in splits]})


def unpack(arrays: Sequence[np.ndarray], header: str, per_model: int) -> tuple[list[Model], list[Split]]:
    """``pack``'s inverse; a message of another shape than its header says is refused in one line."""
    shape = json.loads(header)
    expected = shape["leaves"] * per_model + len(shape["splits"]) * (per_model + 2)
    if len(arrays) != expected:
        raise FedcondError(
            f"CFL's newcomer message holds {len(arrays)} arrays where its tree needs {expected}; "
            "server and client disagree on the model"
        )
    leaves = [list(arrays[i : i + per_model]) for i in range(0, shape["leaves"] * per_model, per_model)]
    splits, at = [], shape["leaves"] * per_model
    for cluster, new_cluster in shape["splits"]:
        model = list(arrays[at : at + per_model])
        directions = (np.asarray(arrays[at + per_model]), np.asarray(arrays[at + per_model + 1]))
        splits.append(Split(cluster, new_cluster, model, directions))
        at += per_model + 2
    return leaves, splits
