"""How models are combined, for every method: plain functions over lists of NumPy arrays.

A model here is ``list[np.ndarray]`` (its ``state_dict`` in order), as it travels over Flower.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from fedcond.config import Option
from fedcond.errors import FedcondError

Model = list[np.ndarray]
#: DAC's k: the peers each client averages with (fedcond.federation.peer) and a newcomer is served the
#: average of (fedcond.clients.dac).
DAC_NEIGHBOURS = Option("dac-neighbours", 3, "DAC: how many most similar peers each client averages with", minimum=1)


def weighted_average(models: Iterable[Model], weights: Sequence[float]) -> Model:
    """Layer-wise average of ``models`` weighted by ``weights`` (sample counts for FedAvg).

    The one averaging rule of every method. It computes as Flower's ``FedAvg`` does (each model
    scaled by its share of the total weight in its own dtype, then summed in order), so FedAvg's
    numbers are the same whether Flower or fedcond averages. ``models`` may be a generator that
    decodes one model at a time: a round of 1,000 clients then never holds 1,000 decoded models.
    """
    total = float(sum(weights))
    if not weights or total <= 0:
        raise FedcondError("nothing to average: no client returned a model with samples")
    # In key order nothing waits: the stream folds each model as it comes (StreamingAverage's rule).
    expected = dict(enumerate(weights))
    stream = StreamingAverage(expected)
    for key, (model, weight) in enumerate(zip(models, weights, strict=True)):
        stream.add(key, model, weight)
    return stream.result(expected)


class StreamingAverage:
    """The weighted average of models that arrive one at a time and in any order, holding only the
    running sum and the few models that came early: a round of 1,000 clients never holds 1,000 replies.

    ``weighted_average`` is this stream fed in key order. Models are folded in key (partition)
    order, each scaled by its weight's share of the ``expected`` total
    (the server knows each client's training samples from its scenario), so a model whose turn has
    not come waits until every smaller key was folded or ``withdraw``-n (it failed). When the models
    that came back, or their weights, are not the expected ones, ``result`` rescales the sum to the
    weights that did come back: the same average, up to float rounding.
    """

    def __init__(self, expected: dict[int, float]) -> None:
        self.expected_total = float(sum(expected.values()))
        if not expected or self.expected_total <= 0:
            raise FedcondError("nothing to average: no client expected to return a model with samples")
        self._queue = sorted(expected)  # keys still to fold or withdraw, smallest first
        self._early: dict[int, tuple[Model, float]] = {}
        self._withdrawn: set[int] = set()
        self._sum: Model = []
        self.weights: dict[int, float] = {}  # the folded keys and their weights, in folding order
        self.largest_backlog = 0  # the most models that ever waited for their turn (memory)

    def add(self, key: int, model: Model, weight: float) -> None:
        """One client's model and weight, whenever it arrives."""
        if key not in self._queue or key in self._early:
            raise FedcondError(f"partition {key} returned a model twice or was not asked this round")
        self._early[key] = (model, float(weight))
        self.largest_backlog = max(self.largest_backlog, len(self._early))
        self._fold_ready()

    def withdraw(self, key: int) -> None:
        """``key`` will return no model (it failed): the keys after it need not wait for it."""
        if key in self._queue and key not in self._early:
            self._withdrawn.add(key)
            self._fold_ready()

    def _fold_ready(self) -> None:
        while self._queue and (self._queue[0] in self._early or self._queue[0] in self._withdrawn):
            key = self._queue.pop(0)
            if key in self._withdrawn:
                continue
            model, weight = self._early.pop(key)
            share = np.float64(weight / self.expected_total)
            if not self.weights:
                self._sum = [_scaled(np.array(layer, copy=True), share) for layer in model]
            else:
                for layer, update in zip(self._sum, model, strict=True):
                    np.add(layer, _scaled(np.array(update, copy=True), share), out=layer)
            self.weights[key] = weight

    def result(self, answered: dict[int, float]) -> Model:
        """The average over ``answered`` (key -> weight: the replies the round counts), which must be
        the keys folded so far; a key still waiting (a smaller one never came back) is folded now."""
        for key in list(self._queue):
            if key not in answered:
                self.withdraw(key)
        if set(self.weights) != set(answered) or self._early:
            raise FedcondError("the streamed average and the round's answers disagree; report this as a bug")
        total = float(sum(answered.values()))
        if total <= 0:
            raise FedcondError("nothing to average: no client returned a model with samples")
        if total == self.expected_total:
            return self._sum
        # Some clients failed or reported other weights: rescale to the total that came back.
        return [_scaled(layer, np.float64(self.expected_total / total)) for layer in self._sum]


def _scaled(layer: np.ndarray, share: np.floating) -> np.ndarray:
    # An integer buffer (batch norm's step count) cannot hold a fraction: it is scaled in its own
    # dtype, exactly as Flower does.
    if np.can_cast(share, layer.dtype, casting="same_kind"):
        return np.multiply(layer, share, out=layer)
    return np.multiply(layer, np.array(share, layer.dtype), out=layer)


def uniform_average(models: Sequence[Model]) -> Model:
    return weighted_average(models, [1.0] * len(models))


def average_per_group(
    current: Sequence[Model], updates: Sequence[Model], groups: Sequence[int], counts: Sequence[int]
) -> list[Model]:
    """One model per group: the sample-weighted average of the updates assigned to it.

    A group no update was assigned to keeps its current model. IFCA's groups are the clients'
    choices; Oracle's are the true clusters (so Oracle never mixes clusters).
    """
    result = [list(model) for model in current]
    for group in range(len(current)):
        members = [i for i, g in enumerate(groups) if g == group]
        if members:
            result[group] = weighted_average([updates[i] for i in members], [counts[i] for i in members])
    return result


def lowest_loss_choice(losses: Sequence[float]) -> int:
    """IFCA's cluster identity step: the model with the lowest training loss (first on ties)."""
    values = np.asarray(losses, dtype=float)
    if not np.all(np.isfinite(values)):
        raise FedcondError("a cluster model's training loss is not finite; lower learning-rate")
    return int(np.argmin(values))


def random_pairs(num_clients: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """A random matching: each client in at most one pair (one left out when the count is odd)."""
    order = rng.permutation(num_clients)
    return [(int(order[i]), int(order[i + 1])) for i in range(0, num_clients - 1, 2)]


def gossip_average(models: Sequence[Model], pairs: Sequence[tuple[int, int]]) -> list[Model]:
    """Each pair replaces both its models by their average; the mean of all models is unchanged."""
    result = [list(model) for model in models]
    for first, second in pairs:
        result[first] = result[second] = uniform_average([models[first], models[second]])
    return result


def flatten(model: Model) -> np.ndarray:
    return np.concatenate([np.asarray(layer, dtype=np.float64).ravel() for layer in model])


def trained_vector(model: Model, trained: Sequence[bool]) -> np.ndarray:
    """The model's trained weights flattened (``trained``: per array, ``fedcond.model.networks.trained_arrays``).
    Buffers are left out wherever models or updates are compared: batch norm's step counter grows
    by each client's step count, which would swamp the weights on a batch-normed network."""
    if len(trained) != len(model):
        raise ValueError(f"a mask of {len(trained)} arrays for a model of {len(model)}")
    return flatten([array for array, is_trained in zip(model, trained, strict=True) if is_trained])


def cosine_similarities(models: Sequence[Model], trained: Sequence[bool]) -> np.ndarray:
    """Pairwise cosine similarity of the models' flattened trained weights (``trained_vector``)."""
    return vector_cosine_similarities(np.stack([trained_vector(model, trained) for model in models]))


def vector_cosine_similarities(vectors: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of the rows of ``vectors`` (a zero row: similarity 0 with all)."""
    norms = np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    unit = vectors / norms
    return unit @ unit.T


def top_k_neighbours(similarity: np.ndarray, k: int) -> list[list[int]]:
    """For each client, the ``k`` most similar other clients (ties broken by lower index)."""
    count = len(similarity)
    k = min(k, count - 1)
    neighbours = []
    for i in range(count):
        others = [j for j in range(count) if j != i]
        # A stable sort on the negated similarity keeps lower indices first on ties: deterministic.
        ranked = sorted(others, key=lambda j: -similarity[i, j])
        neighbours.append(ranked[:k])
    return neighbours


def neighbourhood_average(models: Sequence[Model], neighbours: Sequence[Sequence[int]]) -> list[Model]:
    """DAC's step: each client uniformly averages its model with its neighbours' (all pre-step)."""
    return [uniform_average([models[i], *(models[j] for j in chosen)]) for i, chosen in enumerate(neighbours)]
