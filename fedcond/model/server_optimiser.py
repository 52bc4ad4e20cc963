"""``server-momentum``: FedAvgM, the server's heavy-ball step on the round's averaged update, for
every method whose server averages a model.

FedAvgM (Hsu et al. 2019, "Measuring the Effects of Non-Identical Data Distribution") treats
``current - average`` (the model the round's clients received minus the round's sample-weighted
average of the returned models) as a gradient: ``velocity = momentum * velocity + (current - average)``,
then ``new = current - server-learning-rate * velocity``; the first round's velocity is its update. With
``server-momentum = 0`` and ``server-learning-rate = 1`` the new model is the average: plain FedAvg, and
no optimiser exists at all (``ServerMomentum.of`` is None), so the numbers are those of a run without it.

Flower's ``FedAvgM`` applies the same rule, but to every array, batch norm's running statistics and
its integer step count included; here those buffers are the average as it is (a momentum on a
running variance can make it negative). Its class is a Flower ``FedAvg``, which fedcond's strategies
are not, so the rule lives here and each strategy calls it on the average it already has:

- one global model (FedAvg, Conditional, Ditto, FedProx, FedBN, SCAFFOLD: ``strategies/fedavg.py``),
  with or without SecAgg+: one ``ServerMomentum``;
- one model per cluster (Oracle, IFCA, CFL, descriptor clustering: ``fedcond/federation/cluster_models.py``):
  ``PerModelMomentum``, one independent FedAvgM stream per model, stepped in a round only where some
  reply went into that model's average (a model nobody chose keeps its parameters and its velocity).

The two settings are one shared group (``SERVER_OPTIMISER``: ``fedcond.federation.methods.shared_options``);
a method whose server averages no model (local, gossip, DAC, pFedHN) says why in its strategy's
``server_step_refusal``, and ``check_server_optimiser`` refuses a changed value in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.model.aggregation import Model

SERVER_MOMENTUM = Option(
    "server-momentum",
    0.0,
    "FedAvgM: the server's momentum on the round's averaged update, one velocity per model it averages (0: plain "
    "FedAvg)",
    minimum=0.0,
    maximum=0.99,
)
SERVER_LEARNING_RATE = Option(
    "server-learning-rate",
    1.0,
    "FedAvgM: the server's step on its momentum (1 with server-momentum=0: plain FedAvg; SCAFFOLD's global step size)",
    minimum=0.0,
)
OPTIONS = (SERVER_MOMENTUM, SERVER_LEARNING_RATE)
#: Who reads the two settings (docs/settings.md's "for" column).
OWNER = "every method whose server averages a model"
#: Why a pooled reference takes no server step (it has no strategy to declare it).
POOLED_REFUSAL = "it trains centrally on pooled data, with no federated average"


def is_plain_fedavg(config: RunConfig) -> bool:
    return SERVER_MOMENTUM.of(config) == 0 and SERVER_LEARNING_RATE.of(config) == 1


def check_server_optimiser(config: RunConfig, method: str, refusal: str | None) -> None:
    """The server optimiser against the method, in one line before anything starts. ``refusal``: why
    ``method``'s server has no average to step (a strategy's ``server_step_refusal``); None, it has one."""
    if is_plain_fedavg(config):
        return
    if refusal is not None:
        changed = ", ".join(f"{option.key}={option.of(config):g}" for option in OPTIONS
                            if option.of(config) != option.default)  # fmt: skip
        raise FedcondError(
            f"{changed}: {method} has no server average to step ({refusal}); leave server-momentum=0 and "
            "server-learning-rate=1"
        )
    if SERVER_LEARNING_RATE.of(config) <= 0:
        raise FedcondError(
            f"server-learning-rate must be positive (got {SERVER_LEARNING_RATE.of(config):g}); 1 is plain FedAvg"
        )


class ServerMomentum:
    """The server's FedAvgM state: its velocity, one array per trained array of the model.

    ``trained`` says, per array of the model (``state_dict`` order), whether it is a trained weight
    (stepped) or a buffer such as batch norm's running statistics (the round's average as it is).
    """

    def __init__(self, momentum: float, learning_rate: float, trained: Sequence[bool]) -> None:
        self.momentum = float(momentum)
        self.learning_rate = float(learning_rate)
        self.trained = tuple(trained)
        self.velocity: Model | None = None

    @classmethod
    def of(cls, config: RunConfig, trained: Sequence[bool]) -> ServerMomentum | None:
        """The run's server step, or None where it is plain FedAvg (the average is the new model)."""
        if is_plain_fedavg(config):
            return None
        return cls(SERVER_MOMENTUM.of(config), SERVER_LEARNING_RATE.of(config), trained)

    def step(self, current: Model, average: Model) -> Model:
        """The new global model from the current one and the round's average of the returned models."""
        if not (len(current) == len(average) == len(self.trained)):
            raise FedcondError(
                f"the server step got {len(current)} current and {len(average)} averaged arrays for a model "
                f"of {len(self.trained)}; server and clients disagree on the model"
            )
        updates = [
            (np.asarray(now, dtype=np.float64) - np.asarray(mean, dtype=np.float64)) if trained else None
            for now, mean, trained in zip(current, average, self.trained, strict=True)
        ]
        if self.velocity is None:
            velocity = [update if update is not None else np.zeros(0) for update in updates]
        else:
            velocity = [
                self.momentum * previous + update if update is not None else previous
                for previous, update in zip(self.velocity, updates, strict=True)
            ]
        self.velocity = velocity
        return [
            (np.asarray(now, dtype=np.float64) - self.learning_rate * moving).astype(np.asarray(mean).dtype)
            if trained
            else mean
            for now, mean, moving, trained in zip(current, average, velocity, self.trained, strict=True)
        ]

    def state(self) -> Model:
        """The velocity, for the run's checkpoint (empty before the first round)."""
        return [np.asarray(array, dtype=np.float64) for array in self.velocity] if self.velocity is not None else []

    def load_state(self, velocity: Model) -> None:
        self.velocity = [np.asarray(array, dtype=np.float64) for array in velocity] if velocity else None

    def copy(self) -> ServerMomentum:
        """A stream of its own with this one's settings and velocity (a CFL cluster's half, at its split)."""
        twin = ServerMomentum(self.momentum, self.learning_rate, self.trained)
        twin.load_state(self.state())
        return twin


class PerModelMomentum:
    """FedAvgM for a server that averages several models (one per cluster): one ``ServerMomentum``
    per model, each an independent FedAvgM stream. A model steps in a round only when some reply
    went into its average; one that nobody chose (IFCA) or whose clients all failed keeps its
    parameters, and its velocity is left as it was: it neither decays nor moves the model.
    """

    #: The checkpoint's name of model ``index``'s velocity: ``f"{VELOCITY}-{index}"``.
    VELOCITY = "server-velocity"

    def __init__(self, momentum: float, learning_rate: float, trained: Sequence[bool], count: int) -> None:
        self.momentum = float(momentum)
        self.learning_rate = float(learning_rate)
        self.trained = tuple(trained)
        self.streams = [self.fresh() for _ in range(count)]

    @classmethod
    def of(cls, config: RunConfig, trained: Callable[[], Sequence[bool]], count: int) -> PerModelMomentum | None:
        """The run's per-model server step, or None where it is plain FedAvg (each average is the new
        model). ``trained`` is called only where there is a step (it builds a model to tell)."""
        if is_plain_fedavg(config):
            return None
        return cls(SERVER_MOMENTUM.of(config), SERVER_LEARNING_RATE.of(config), trained(), count)

    def fresh(self) -> ServerMomentum:
        return ServerMomentum(self.momentum, self.learning_rate, self.trained)

    def reset(self, count: int) -> None:
        """``count`` models, each with a fresh stream (descriptor clustering, once it found its clusters)."""
        self.streams = [self.fresh() for _ in range(count)]

    def add_copy_of(self, index: int) -> None:
        """One more model, whose stream starts as a copy of model ``index``'s (a CFL split)."""
        self.streams.append(self.streams[index].copy())

    def step(self, current: Sequence[Model], averages: Sequence[Model], averaged: Collection[int]) -> list[Model]:
        """The new models from the models the round's clients received (``current``) and the round's
        per-model averages; only the models in ``averaged`` step, the others are their average (kept)."""
        if not (len(current) == len(averages) == len(self.streams)):
            raise FedcondError(
                f"the server step has {len(self.streams)} velocities for {len(current)} models; report this as a bug"
            )
        return [
            self.streams[index].step(now, average) if index in averaged else list(average)
            for index, (now, average) in enumerate(zip(current, averages, strict=True))
        ]

    def state(self) -> dict[str, Model]:
        """Each model's velocity by name, for the run's checkpoint (empty before the model's first step)."""
        return {f"{self.VELOCITY}-{index}": stream.state() for index, stream in enumerate(self.streams)}

    def load_state(self, models: Mapping[str, Model], count: int) -> None:
        """``count`` models' streams, each with its velocity from the checkpoint's ``models``."""
        self.reset(count)
        for index, stream in enumerate(self.streams):
            stream.load_state(models.get(f"{self.VELOCITY}-{index}", []))
