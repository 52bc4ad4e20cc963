"""What a method declares about itself, in its own strategy module (``strategies/<method>.py``):
``METHOD = Declaration(...)``. The method table (``fedcond.federation.methods``) finds the declarations by
the modules' names, as FL-bench finds a method's files; nothing else lists methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedcond.federation.server_method import ServerMethod

#: The kinds of newcomer rule (``Facts.newcomer_rule``): what a client that never trained is served.
#: ``tests/test_method_rules.py`` checks each kind on hand-made models.
NEWCOMER_RULES = (
    "global", "global with its fingerprint", "true cluster", "lowest-loss cluster", "own untrained",
    "random peer", "lowest-loss peers", "nearest descriptor", "split tree", "mean embedding",
)  # fmt: skip


#: How a message reaches the server (``Release.channel``): summed by SecAgg+ when the run sets
#: ``secure-aggregation=secaggplus`` (a model update); summed by SecAgg+ in every run (the fingerprint
#: statistics); or never summed.
WITH_SECURE_AGGREGATION = "with-secure-aggregation"
ALWAYS_SUMMED = "always-summed"
IN_THE_CLEAR = "in-the-clear"
CHANNELS = (WITH_SECURE_AGGREGATION, ALWAYS_SUMMED, IN_THE_CLEAR)


@dataclass(frozen=True)
class Release:
    """One message a method's client sends, as an honest-but-curious server reads it: when, what it
    holds, what the server learns from it in the clear, and whether SecAgg+ sums it
    (docs/privacy.md's table of what leaves a client is generated from these)."""

    when: str
    content: str
    learns: str
    channel: str = WITH_SECURE_AGGREGATION


@dataclass(frozen=True)
class Facts:
    """A federated method in words, declared once: the README's method table and the newcomer and
    drift tables of docs/newcomers.md are generated from these (``python -m tools.docs``, from a checkout)."""

    #: What each client does in a round; what the server does; the model a client is scored with;
    #: what travels each round.
    client: str
    server: str
    evaluated_with: str
    communication: str
    #: What a newcomer (a client that never trained) is served, where the code does it, and the
    #: kind of rule (one of ``NEWCOMER_RULES``).
    newcomer: str
    newcomer_code: str
    newcomer_rule: str
    #: What the method does for a client whose data changed mid-run (``drift-fraction``).
    drift: str
    #: The server holds more than the global model between rounds (per-cluster or per-client models,
    #: assignments, a hypernetwork; FedAvgM's velocity of each averaged model, with ``server-momentum``):
    #: its strategy extends ``state``, which the checkpoint saves.
    server_state: bool = False
    #: What its client sends beyond what every client sends (``EVERY_CLIENT_RELEASES``), message by
    #: message: at least its training reply.
    releases: tuple[Release, ...] = ()


#: What every method's client sends, whatever the method.
EVERY_CLIENT_RELEASES = (
    Release(
        "before round 1",
        "its partition id: the name its node's operator configured (`--node-config partition-id`)",
        "which node holds which partition, the name it keeps per-client state by; no reply names a cluster",
        IN_THE_CLEAR,
    ),
    Release(
        "each evaluation (in the next training reply with evaluate-in-fit)",
        "the test loss, test accuracy and test-sample count of the model it was sent; with "
        "`validation-fraction`, its validation accuracy and count; with `per-class-accuracy`, each class's "
        "correct and total counts in the final round",
        "how well each model serves each client, and the size of its test set",
        IN_THE_CLEAR,
    ),
    Release(
        "each training reply, with a sample-level DP setting",
        "its cumulative epsilon (under DP-SGD the training loss is withheld: NaN)",
        "how much of its privacy budget the client has spent",
        IN_THE_CLEAR,
    ),
)

#: The words several methods share.
FEDAVG_COMMUNICATION = "as FedAvg"
#: The training reply of a client that returns the model it trained (FedAvg's).
MODEL_REPLY = Release(
    "each training round",
    "the model after local training, its training-sample count n and its last epoch's training loss",
    "the client's model update, what its data did to the model in the round (from which gradient-inversion "
    "attacks reconstruct training images)",
)
GLOBAL_NEWCOMER = ("the global model", "`FedcondClient.newcomer_model`", "global")
NOTHING_ON_DRIFT = "nothing to do: the global model is every client's"
#: The training reply of a peer-to-peer method's client (Gossip's, DAC's): its model, to its peers.
PEER_MODEL_REPLY = Release(
    "each training round",
    "the model after local training, n and its training loss, for the peers the server stands in for",
    "in a deployment, each peer it is sent to receives the client's model; here the server that simulates the "
    "network sees every client's",
)
KEEPS_MODEL_ON_DRIFT = "nothing to do: its client keeps its model and its peers"


@dataclass(frozen=True)
class Declaration:
    """A federated method, declared once in its strategy module: its summary, its strategy class,
    its facts, and whether it is one of the paper's eight or a competitor the paper did not run
    (docs/baselines.md). Its client is ``Client`` in ``clients/<method>.py``; its settings are the
    ``Option``s of its two classes."""

    summary: str
    strategy: type[ServerMethod]
    facts: Facts
    competitor: bool = False
    #: The run-config settings under which the tests that run every method run this one, on top of
    #: their small digits federation: only what the method cannot run without (FedBN: a network with
    #: batch norm). ``tests/conftest.py: method_test_settings`` writes the data such a dataset needs.
    test_settings: Mapping[str, Any] = field(default_factory=dict)
