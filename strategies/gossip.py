"""Gossip: a simulated peer-to-peer network; each round a random matching, each pair averages its models."""

from __future__ import annotations

import numpy as np
from flwr.common import Parameters, ndarrays_to_parameters

from fedcond.federation.declaration import KEEPS_MODEL_ON_DRIFT, PEER_MODEL_REPLY, Declaration, Facts
from fedcond.federation.peer import PeerToPeer
from fedcond.model.aggregation import (
    Model,
    gossip_average,
    random_pairs,
)
from fedcond.newcomers import random_peer


class GossipStrategy(PeerToPeer):
    """Gossip: each round, after local training, the clients that answered are paired by a fresh
    random matching (a random topology; one client sits out when the count is odd) and each pair
    averages its two models. Pairing is seeded by (seed, round): same seed and same clients, same pairs.
    """

    server_step_refusal = "each client averages its model with one random peer's"

    def newcomer_parameters(self, partition_id: int) -> Parameters:
        """A newcomer gossips too: it is served one training client's model, drawn anew each round."""
        config = self.inputs.config
        peer = random_peer(config.seed, self.protocol.participation.round, partition_id, config.num_training_clients)
        return ndarrays_to_parameters(self.models[peer])

    def mix(self, server_round: int, models: list[Model]) -> tuple[list[Model], int]:
        pairs = random_pairs(len(models), np.random.default_rng([self.inputs.config.seed, server_round]))
        return gossip_average(models, pairs), 2 * len(pairs)


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "random pairwise averaging of per-client models",
    GossipStrategy,
    Facts(
        "trains its own model", "simulates the network: a random matching each round, each pair averages",
        "own model", "2 models per pair, peer to peer",
        "one training client's model, drawn anew each round by a generator seeded with (seed, round, partition): its "
        "one random peer", "`GossipStrategy.newcomer_parameters`", "random peer", KEEPS_MODEL_ON_DRIFT,
        server_state=True,
        releases=(
            PEER_MODEL_REPLY,
        ),
    ),
)  # fmt: skip
