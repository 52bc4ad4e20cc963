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


#: The words several methods share.
FEDAVG_COMMUNICATION = "as FedAvg"
GLOBAL_NEWCOMER = ("the global model", "`FedcondClient.newcomer_model`", "global")
NOTHING_ON_DRIFT = "nothing to do: the global model is every client's"
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
