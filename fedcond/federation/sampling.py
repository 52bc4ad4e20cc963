"""Client sampling: which training clients a round asks, and which rounds evaluate every client.

The sample of round r is drawn by a generator seeded with (run seed, r) over partition ids, never
over Flower's node ids (new in every run) or with an unseeded generator (Flower's
``ClientManager.sample`` uses ``random.sample`` over node ids): two runs with one seed ask the same
clients in every round, and a resumed run asks in its round r what the uninterrupted run asked.
"""

from __future__ import annotations

import numpy as np

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError

CLIENTS_PER_ROUND = Option(
    "clients-per-round",
    0,
    "training clients asked each round, drawn anew every round (seeded by seed and round); 0 = every one",
    minimum=0,
)
EVALUATE_EVERY = Option(
    "evaluate-every",
    1,
    "with clients-per-round: every this many rounds (and after the last) every training client evaluates; in "
    "between, a round's model is scored by the clients sampled to evaluate it",
    minimum=1,
)
#: Keeps the sample's generator apart from every other generator seeded by (seed, round).
SAMPLING_STREAM = 0x5A3D1E


def sample_partitions(seed: int, server_round: int, partitions: range, count: int) -> list[int]:
    """``count`` of ``partitions`` for round ``server_round`` (all of them when ``count`` is 0), sorted."""
    if count == 0 or count >= len(partitions):
        return list(partitions)
    rng = np.random.default_rng([seed, server_round, SAMPLING_STREAM])
    chosen = rng.choice(len(partitions), size=count, replace=False)
    return sorted(partitions[index] for index in chosen)


def clients_per_round(config: RunConfig) -> int:
    """The training clients each round asks: its sample, or every one."""
    return CLIENTS_PER_ROUND.of(config) or config.num_training_clients


def samples(config: RunConfig) -> bool:
    return clients_per_round(config) < config.num_training_clients


def scheduled_for_everyone(config: RunConfig, server_round: int) -> bool:
    """Whether every training client is asked to evaluate round ``server_round``'s model after it,
    whatever the protocol: after the last round, and every ``evaluate-every`` rounds of a sample."""
    last = server_round >= config.num_server_rounds
    return last or (samples(config) and server_round % EVALUATE_EVERY.of(config) == 0)


def evaluates_everyone(config: RunConfig, server_round: int) -> bool:
    """Whether every training client evaluates round ``server_round``'s model."""
    return not samples(config) or scheduled_for_everyone(config, server_round)


def check_sampling(config: RunConfig, secure_min_clients: int | None) -> None:
    """Sampling against the federation and the privacy settings (``fedcond.federation.checks`` says which are
    on: ``secure_min_clients`` is ``secagg-min-clients`` when SecAgg+ sums each round's updates), in
    one line each. SecAgg+'s shares and threshold are fractions, so they apply to each round's sample."""
    per_round = CLIENTS_PER_ROUND.of(config)
    if per_round > config.num_training_clients:
        raise FedcondError(
            f"clients-per-round={per_round} is more than the {config.num_training_clients} training clients "
            f"(num-clusters x clients-per-cluster); give at most {config.num_training_clients}, or 0 for all"
        )
    if not samples(config):
        if EVALUATE_EVERY.of(config) != 1:
            raise FedcondError(
                "evaluate-every applies with clients-per-round (every client evaluates every round without it); "
                "set clients-per-round or leave evaluate-every at 1"
            )
        return
    if secure_min_clients is not None and secure_min_clients > per_round:
        raise FedcondError(
            f"each round's updates are summed securely over at least secagg-min-clients={secure_min_clients} "
            f"clients, but clients-per-round={per_round} asks fewer; raise clients-per-round or lower "
            "secagg-min-clients"
        )


class RoundSchedule:
    """Whom a round asks: its sample of training clients (``clients-per-round``), the training clients
    that evaluate its model by an evaluate message (``evaluate-every``, evaluate-in-fit), and the
    held-out clients, who evaluate every round and never train."""

    def __init__(self, config: RunConfig, evaluates_in_fit: bool) -> None:
        self.config = config
        #: The training clients evaluate each round's model in the next round's fit (one message a round).
        self.evaluates_in_fit = evaluates_in_fit
        self.training_partitions = range(config.num_training_clients)
        self.held_out = range(config.num_training_clients, config.num_clients)
        #: This round's training clients (every one before round 1).
        self.sampled: list[int] = list(self.training_partitions)

    def sample(self, server_round: int) -> list[int]:
        """The round's sample of training clients (every one without clients-per-round), whatever each
        did before."""
        config = self.config
        self.sampled = sample_partitions(config.seed, server_round, self.training_partitions, clients_per_round(config))
        return self.sampled

    def defers_evaluation(self, server_round: int) -> bool:
        """Whether the training clients evaluate round ``server_round``'s model in the next round's fit
        (those the next round samples), rather than by evaluate messages after this round."""
        return self.evaluates_in_fit and not scheduled_for_everyone(self.config, server_round)

    def evaluated_in(self, server_round: int) -> list[int]:
        """The training clients that evaluate round ``server_round``'s model by an evaluate message."""
        if self.defers_evaluation(server_round):
            return []
        if evaluates_everyone(self.config, server_round):
            return list(self.training_partitions)
        return self.sampled

    def asked_in(self, server_round: int) -> list[int]:
        """Every client a round asks anything: its sample, the evaluating clients, the held-out ones."""
        return sorted({*self.sampled, *self.evaluated_in(server_round), *self.held_out})
