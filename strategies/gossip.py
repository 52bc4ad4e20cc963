"""Gossip: a simulated peer-to-peer network; each round a random matching, each pair averages its models."""

from strategies.declaration import KEEPS_MODEL_ON_DRIFT, Declaration, Facts
from strategies.peer import GossipStrategy

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
    ),
)  # fmt: skip
