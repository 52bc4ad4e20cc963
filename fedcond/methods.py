"""The method registry: a method is a client behaviour paired with a strategy, found by name.

Adding a method is one new file (its client and/or strategy) plus one line in ``registry()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.history import RunRecorder

if TYPE_CHECKING:
    from flwr.client import NumPyClient
    from flwr.common import Context
    from flwr.server.strategy import Strategy

    from fedcond.client_data import ClientData


@dataclass(frozen=True)
class ServerSetup:
    """What a strategy is built from."""

    config: RunConfig
    num_classes: int
    num_clusters: int
    conditioned: bool
    recorder: RunRecorder | None


@dataclass(frozen=True)
class Method:
    """A named pairing: how each client behaves and which strategy the server runs."""

    name: str
    summary: str
    conditioned: bool
    #: None for the pooled reference methods, which train centrally, in-process, without Flower.
    make_client: Callable[[RunConfig, ClientData, Context, bool], NumPyClient] | None
    make_strategy: Callable[[ServerSetup], Strategy] | None
    #: What a held-out client (one that never trains) is evaluated with; empty: no meaning here.
    held_out_model: str = ""
    #: "federated" (Flower rounds) or "pooled" (the paper's centralised protocol, ``fedcond.pooled``).
    protocol: str = "federated"


@functools.cache
def registry() -> dict[str, Method]:
    """Every method by name."""
    # Imported here so that fedcond's core never imports Flower unless a method is actually used.
    from clients.ditto_client import DittoClient
    from clients.ifca_client import IfcaClient
    from clients.local_client import LocalClient
    from clients.numpy_client import FedcondClient
    from strategies.cluster_models import IfcaStrategy, OracleStrategy
    from strategies.fedavg import FedcondFedAvg
    from strategies.local import LocalStrategy
    from strategies.peer import DacStrategy, GossipStrategy

    # fmt: off
    methods = (
        Method("fedavg", "one global backbone CNN, FedAvg over all clients", False, FedcondClient, FedcondFedAvg,
               "the global model"),
        Method("conditional", "one global CNN fed each client's fingerprint", True, FedcondClient, FedcondFedAvg,
               "the global model fed its own fingerprint"),
        Method("local", "each client trains only its own model", False, LocalClient, LocalStrategy),
        Method("oracle", "FedAvg within each true cluster (reference)", False, FedcondClient, OracleStrategy,
               "its true cluster's model"),
        Method("ifca", "K models, each client trains its lowest-loss one", False, IfcaClient, IfcaStrategy),
        Method("ditto", "personal models pulled towards FedAvg's", False, DittoClient, FedcondFedAvg,
               "the global model (it has no personal model)"),
        Method("gossip", "random pairwise averaging of per-client models", False, FedcondClient, GossipStrategy),
        Method("dac", "averaging with the top-k cosine-similar peers", False, FedcondClient, DacStrategy),
        # The paper's own protocol, centrally pooled (a reference, not a federated method).
        Method("pooled-conditional", "the paper's protocol: one conditioned CNN on all clients' pooled data", True,
               None, None, "the pooled model fed its own fingerprint", "pooled"),
        Method("pooled-oracle", "the paper's protocol: one CNN per true cluster on its pooled data", False,
               None, None, "its true cluster's model", "pooled"),
        Method("pooled-global", "the paper's protocol: one CNN on all clients' pooled data", False,
               None, None, "the pooled model", "pooled"),
    )
    # fmt: on
    return {method.name: method for method in methods}


def get_method(name: str) -> Method:
    """The registered method ``name``, or a one-line error listing the known ones."""
    methods = registry()
    if name not in methods:
        raise FedcondError(f"unknown method '{name}'; choose one of {', '.join(methods)}")
    return methods[name]


def check_held_out(method: Method, config: RunConfig) -> None:
    """Refuse held-out clients where a client that never trains has no model to be evaluated with."""
    if config.held_out_clients and not method.held_out_model:
        supported = ", ".join(name for name, known in registry().items() if known.held_out_model)
        raise FedcondError(
            f"held-out-clients has no meaning for {method.name} (a client that never trains has no model of "
            f"its own there); set held-out-clients=0 or use one of {supported}"
        )


def method_names(selection: str) -> list[str]:
    """``all``: every federated method (the paper's comparison); ``pooled``: the pooled reference family."""
    protocol = "pooled" if selection == "pooled" else "federated"
    return [name for name, method in registry().items() if method.protocol == protocol]


def check_federated(method: Method) -> None:
    """Flower runs only federated methods; the pooled ones train in-process (``fedcond run`` does that)."""
    if method.make_client is None or method.make_strategy is None:
        raise FedcondError(
            f"{method.name} is the paper's centrally pooled protocol, not a federation; run it with "
            "fedcond run, compare or sweep (they train it in-process), not with flwr run"
        )
