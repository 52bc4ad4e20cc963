"""The method table: a method is a client behaviour paired with a strategy, found by name.

Adding a method is its client file and/or strategy file plus one line in ``registry()``; the
method's own settings (``options``) and whether it serves held-out clients are declared on its
classes, next to the code that reads them. Entries name their classes (``module:Class``) and import
them when first asked for, so that a ClientApp process loads its own client class and nothing of
the servers'. How settings fit together, before anything starts, is ``strategies.checks``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedcond import privacy, secagg_settings
from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.history import CHECKPOINT_EVERY, RESUME
from fedcond.live_curves import LIVE_CURVES
from fedcond.metrics import PER_CLASS_ACCURACY
from fedcond.newcomers import NEWCOMER_STEPS
from fedcond.pooled import POOLED_METHODS

if TYPE_CHECKING:
    from strategies.base import FedcondStrategy


@functools.cache
def load_class(path: str) -> type:
    """``module:Class``, imported now."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Method:
    """A named pairing: how each client behaves and which strategy the server runs.

    ``client_path`` and ``strategy_path`` are ``module:Class`` (None for the pooled references,
    which train centrally, in-process, without Flower); ``client`` and ``strategy`` import them.
    """

    name: str
    summary: str
    client_path: str | None
    strategy_path: str | None
    #: "federated" (Flower rounds) or "pooled" (the paper's centralised protocol, ``fedcond.pooled``).
    protocol: str = "federated"
    #: A pooled reference's model takes the fingerprint (a federated method's client class says so).
    pooled_conditioned: bool = False
    #: A named variant: the method it runs (``variant_of``) and the settings it fixes on top of it.
    variant_of: str = ""
    fixed_settings: tuple[tuple[str, Any], ...] = ()
    #: Not in the paper's comparison: a method of the field a reviewer asks about (docs/baselines.md).
    #: ``--methods competitors`` names these; ``all`` stays the paper's eight.
    competitor: bool = False

    @property
    def client(self) -> type[Any] | None:
        """The client class (a ``clients.fedcond_client.FedcondClient``; named by its path only, so
        that nothing in ``strategies/`` imports ``clients/``)."""
        return load_class(self.client_path) if self.client_path else None

    @property
    def strategy(self) -> type[FedcondStrategy] | None:
        return load_class(self.strategy_path) if self.strategy_path else None

    @property
    def conditioned(self) -> bool:
        """Whether the model is fed the client's fingerprint: one source, the client class that feeds
        it (``ConditionalClient``), or the pooled reference's entry."""
        client = self.client
        return client.conditioned if client is not None else self.pooled_conditioned

    @property
    def options(self) -> tuple[Option, ...]:
        """The method's own settings and, for a federated method, the round protocol's."""
        own = tuple(option for part in (self.client, self.strategy) if part is not None for option in part.options)
        return own + (self.strategy.protocol_options if self.strategy is not None else ())

    @property
    def state_lost_on_resume(self) -> str:
        """What a resumed run of this method starts afresh (kept on clients, not in the checkpoint)."""
        return self.client.state_lost_on_resume if self.client is not None else ""

    @property
    def needs_true_clusters(self) -> bool:
        """Whether the method is told the true clusters (Oracle, pooled-oracle): a reference, not a method."""
        if self.strategy is None:
            from fedcond.pooled import POOLED_METHODS

            return POOLED_METHODS[self.variant_of or self.name].scope == "cluster"
        return self.strategy.uses_true_clusters

    @property
    def serves_held_out_clients(self) -> bool:
        if self.strategy is None:  # pooled: a newcomer gets the pooled model (or its true cluster's)
            return self.protocol == "pooled"
        return self.strategy.serves_held_out_clients


FEDAVG_CLIENT, FEDAVG = "clients.fedcond_client:FedcondClient", "strategies.fedavg:FedcondFedAvg"
CONDITIONAL_CLIENT, CONDITIONAL = (
    "clients.conditional_client:ConditionalClient",
    "strategies.conditional:ConditionalFedAvg",
)


@functools.cache
def registry() -> dict[str, Method]:
    """Every method by name, in the order reports list them."""
    methods = (
        Method("fedavg", "one global backbone CNN, FedAvg over all clients", FEDAVG_CLIENT, FEDAVG),
        Method("conditional", "one global CNN fed each client's fingerprint", CONDITIONAL_CLIENT, CONDITIONAL),
        # Not the paper's method: a named variant of it (docs/instability.md), never swapped in silently.
        Method(
            "recommended", "conditional with a label-aware fingerprint generating the output layer",
            CONDITIONAL_CLIENT, CONDITIONAL, variant_of="conditional",
            fixed_settings=(("fingerprint", "class-mean"), ("conditioning", "hyper")),
        ),
        # recommended with the generated head read at the scale of a plain head (docs/instability.md,
        # "Real images"): what survives federated averaging on CIFAR-10.
        Method(
            "scaled-hyper", "recommended with the fingerprint read at 1/sqrt(d) and the generated head started at zero",
            CONDITIONAL_CLIENT, CONDITIONAL, variant_of="conditional",
            fixed_settings=(("fingerprint", "class-mean"), ("conditioning", "hyper"), ("condition-scale", "unit"),
                            ("hyper-init", "zero")),
        ),
        Method("local", "each client trains only its own model", "clients.local_client:LocalClient",
               "strategies.local:LocalStrategy"),
        Method("oracle", "FedAvg within each true cluster (reference)", FEDAVG_CLIENT,
               "strategies.cluster_models:OracleStrategy"),
        Method("ifca", "K models, each client trains its lowest-loss one", "clients.ifca_client:IfcaClient",
               "strategies.cluster_models:IfcaStrategy"),
        Method("ditto", "personal models pulled towards FedAvg's", "clients.ditto_client:DittoClient", FEDAVG),
        Method("gossip", "random pairwise averaging of per-client models", FEDAVG_CLIENT,
               "strategies.peer:GossipStrategy"),
        Method("dac", "averaging with the top-k cosine-similar peers", "clients.dac_client:DacClient",
               "strategies.peer:DacStrategy"),
        # Beyond the paper: the competitors a reviewer asks about (docs/baselines.md).
        Method("fedprox", "FedAvg with each client's training pulled towards the global model",
               "clients.fedprox_client:FedProxClient", FEDAVG, competitor=True),
        Method("descriptor-clustering", "one model per cluster DBSCAN finds in the clients' descriptors (K not given)",
               "clients.descriptor_client:DescriptorClient", "strategies.cluster_models:DescriptorClusteringStrategy",
               competitor=True),
        Method("cfl", "clusters split recursively by the cosine similarity of the clients' updates (K not given)",
               "clients.cfl_client:CflClient", "strategies.cfl:CflStrategy", competitor=True),
        Method("pfedhn", "a server-side hypernetwork generates each client's model from its learned embedding",
               "clients.pfedhn_client:PFedHNClient", "strategies.pfedhn:PFedHNStrategy", competitor=True),
        # The paper's own protocol, centrally pooled (a reference, not a federated method): fedcond.pooled.
        *(Method(name, spec.summary, None, None, "pooled", spec.conditioned) for name, spec in POOLED_METHODS.items()),
    )  # fmt: skip
    return {method.name: method for method in methods}


def get_method(name: str) -> Method:
    """The registered method ``name``, or a one-line error listing the known ones."""
    methods = registry()
    if name not in methods:
        raise FedcondError(f"unknown method '{name}'; choose one of {', '.join(methods)}")
    return methods[name]


@dataclass(frozen=True)
class SharedOptions:
    """Settings that belong to no one method: every federated method has them (or the run itself
    does), each declared next to the code that reads it; ``topic`` is their heading in
    docs/settings.md (fedcond.tools.settings)."""

    topic: str
    owner: str
    options: tuple[Option, ...]


EVERY_METHOD = "every federated method"
#: The shared settings a ClientApp reads (its sample-level privacy, its secure aggregation, what a
#: newcomer does): a client types and checks these, its own class's and the core settings.
CLIENT_SHARED = (
    SharedOptions("privacy", EVERY_METHOD, privacy.OPTIONS),
    SharedOptions("secure-aggregation", EVERY_METHOD, secagg_settings.OPTIONS),
    SharedOptions("newcomers", EVERY_METHOD, (NEWCOMER_STEPS,)),
    SharedOptions("evaluation", EVERY_METHOD, (PER_CLASS_ACCURACY,)),
)
CLIENT_SHARED_OPTIONS = tuple(option for group in CLIENT_SHARED for option in group.options)


def shared_options() -> tuple[SharedOptions, ...]:
    """Every shared setting: the clients' (``CLIENT_SHARED``), the server's client-level DP
    (strategies.client_dp, imported here: a ClientApp never needs it) and the run's own (resume)."""
    from strategies import client_dp

    return (
        *CLIENT_SHARED,
        SharedOptions("privacy", EVERY_METHOD, client_dp.OPTIONS),
        SharedOptions("resume", "the run", (RESUME, CHECKPOINT_EVERY)),
        SharedOptions("files", "the run", (LIVE_CURVES,)),
    )


def declared_options() -> tuple[Option, ...]:
    """Every method's options, each once (methods may share a class), and every shared setting."""
    unique = {option.key: option for method in registry().values() for option in method.options}
    unique.update({option.key: option for group in shared_options() for option in group.options})
    return tuple(unique.values())


def run_config(mapping: Mapping[str, Any], explicit: Mapping[str, Any] | None = None) -> RunConfig:
    """A run configuration from run-config keys, the methods' own options and a named variant's
    fixed settings included; ``explicit`` are the keys the user gave (the rest are defaults)."""
    return RunConfig.from_mapping(with_variant_settings(mapping, explicit), declared_options())


def client_run_config(mapping: Mapping[str, Any]) -> RunConfig:
    """The run configuration as a ClientApp reads it: the core settings and the options of its own
    client class and of the shared privacy settings, typed and checked; other methods' and the
    server's options kept as given (the ServerApp checked them all before any client was asked)."""
    method = get_method(str(mapping.get("method", RunConfig.method)))
    own = (*(method.client.options if method.client is not None else ()), *CLIENT_SHARED_OPTIONS)
    return RunConfig.from_mapping(with_variant_settings(mapping), own, keep_unknown=True)


def with_variant_settings(mapping: Mapping[str, Any], explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``mapping`` with the settings its method fixes, if it names a variant (``method=recommended``).

    A setting the user gave (``explicit``) with another value is refused: the run would not be the
    variant its name says. Where only the merged run config is known (Flower's, which holds every
    key), a setting at its default takes the variant's value and any other value is refused.
    """
    method = registry().get(str(mapping.get("method", RunConfig.method)))
    if method is None or not method.fixed_settings:
        return dict(mapping)
    defaults = RunConfig().to_mapping()
    for key, value in method.fixed_settings:
        given = mapping.get(key, value)
        allowed = (value,) if explicit is not None and key in explicit else (value, defaults[key])
        if given not in allowed:
            raise FedcondError(
                f"method={method.name} is {method.variant_of} with {key}={value}; drop {key}={given}, "
                f"or use method={method.variant_of} to choose {key} yourself"
            )
    return {**mapping, **dict(method.fixed_settings)}


#: What ``--methods`` (and a grid's ``method``) may name besides single methods.
METHOD_SELECTIONS = ("all", "variants", "competitors", "pooled")


def method_names(selection: str) -> list[str]:
    """``all``: every federated method of the paper's comparison; ``variants``: our named variants;
    ``competitors``: the field's methods beyond the paper's; ``pooled``: the pooled reference family."""
    methods = registry().items()
    if selection == "variants":
        return [name for name, method in methods if method.variant_of]
    if selection == "competitors":
        return [name for name, method in methods if method.competitor]
    protocol = "pooled" if selection == "pooled" else "federated"
    return [
        name for name, method in methods
        if method.protocol == protocol and not method.variant_of and not method.competitor
    ]  # fmt: skip


def flower_method_names() -> list[str]:
    """Every method Flower runs: the paper's, our variants and the competitors (what end-to-end tests
    parametrise over, so that a new method gets them)."""
    return [*method_names("all"), *method_names("variants"), *method_names("competitors")]


def held_out_methods() -> list[str]:
    """Federated methods (variants too) under which a client that never trains has a model to evaluate."""
    return [name for name in flower_method_names() if registry()[name].serves_held_out_clients]


def federated(method: Method) -> tuple[type[Any], type[FedcondStrategy]]:
    """The method's client and strategy classes; Flower runs only federated methods."""
    if method.client_path is None or method.strategy_path is None:
        raise FedcondError(
            f"{method.name} is the paper's centrally pooled protocol, not a federation; run it with "
            "fedcond run, compare or sweep (they train it in-process), not with flwr run"
        )
    return method.client, method.strategy
