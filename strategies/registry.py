"""The method table: a method is a client behaviour paired with a strategy, found by name.

A method's client is ``Client`` in ``clients/<method>.py`` (``fedcond.variants.client_path``: the
ClientApp finds it the same way without this table); its entry here names its strategy class and
declares its facts. The method's own settings (``options``) and whether it serves held-out clients
are declared on its classes, next to the code that reads them. Entries import their classes when
first asked for. Named variants come from ``fedcond.variants``. How settings fit together, before
anything starts, is ``strategies.checks``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.history import CHECKPOINT_EVERY, RESUME
from fedcond.live_curves import LIVE_CURVES
from fedcond.pooled import POOLED_METHODS
from fedcond.shared_options import CLIENT_SHARED, EVERY_METHOD, SharedOptions
from fedcond.variants import VARIANTS, client_path, with_variant_settings

if TYPE_CHECKING:
    from strategies.base import FedcondStrategy


@functools.cache
def load_class(path: str) -> type:
    """``module:Class``, imported now."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


#: The kinds of newcomer rule (``Facts.newcomer_rule``): what a client that never trained is served.
#: ``tests/test_method_rules.py`` checks each kind on hand-made models.
NEWCOMER_RULES = (
    "global", "global with its fingerprint", "true cluster", "lowest-loss cluster", "own untrained",
    "random peer", "lowest-loss peers", "nearest descriptor", "split tree", "mean embedding",
)  # fmt: skip


@dataclass(frozen=True)
class Facts:
    """A federated method in words, declared once: the README's method table and the newcomer and
    drift tables of docs/newcomers.md are generated from these (``fedcond settings --write``)."""

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
    #: assignments, a hypernetwork): its strategy extends ``state``, which the checkpoint saves.
    server_state: bool = False


@dataclass(frozen=True)
class Method:
    """A named pairing: how each client behaves and which strategy the server runs.

    ``strategy_path`` is ``module:Class`` (None for the pooled references, which train centrally,
    in-process, without Flower); ``client`` and ``strategy`` import the classes.
    """

    name: str
    summary: str
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
    #: The method in words (a named variant has its base method's; pooled references have none).
    own_facts: Facts | None = None

    @property
    def facts(self) -> Facts | None:
        return registry()[self.variant_of].own_facts if self.variant_of else self.own_facts

    @property
    def client_path(self) -> str | None:
        return client_path(self.name) if self.protocol == "federated" else None

    @property
    def client(self) -> type[Any] | None:
        """The client class (a ``clients.fedcond_client.FedcondClient``; found by the method's name,
        so that nothing in ``strategies/`` imports ``clients/``)."""
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


FEDAVG, CONDITIONAL = "strategies.fedavg:FedcondFedAvg", "strategies.conditional:ConditionalFedAvg"


FEDAVG_COMMUNICATION = "as FedAvg"
GLOBAL_NEWCOMER = ("the global model", "`FedcondClient.newcomer_model`", "global")
NOTHING_ON_DRIFT = "nothing to do: the global model is every client's"
KEEPS_MODEL_ON_DRIFT = "nothing to do: its client keeps its model and its peers"


# Each federated method in words (``Facts``), named by its one entry in ``registry()`` below.
FACTS_FEDAVG = Facts(
        "trains the global model", "FedAvg (sample-weighted)", "global model", "model down and up, every client",
        *GLOBAL_NEWCOMER, NOTHING_ON_DRIFT,
    )  # fmt: skip
FACTS_CONDITIONAL = Facts(
        "same, model fed its fingerprint", "FedAvg", "global model + own fingerprint",
        "as FedAvg, plus a one-off SecAgg+ sum of fingerprint statistics",
        "the global model, fed the newcomer's own fingerprint (normalised by the published statistics, which it "
        "never entered); with `feature-norm=local-batch`, its batch-norm statistics recomputed first on its own "
        "unlabelled training images (AdaBN)",
        "`FedcondClient.newcomer_model`, with `ConditionalClient.condition`", "global with its fingerprint",
        "recompute the fingerprint on the new data (`drift-fingerprint = \"recompute\"`, the default), or keep the "
        "`stale` one; normalised by the statistics published before round 1",
    )  # fmt: skip
FACTS_LOCAL = Facts(
        "trains its own model, kept in client state", "schedules rounds only", "own model", "nothing",
        "a model of its own, never trained: chance zero-shot, only its k steps teach it",
        "`LocalClient.newcomer_model`", "own untrained",
        "keeps its personal model, trained on the old data, and goes on training it on the new",
    )  # fmt: skip
FACTS_ORACLE = Facts(
        "trains its cluster's model", "FedAvg within each **true** cluster (a reference, not a competitor)",
        "its cluster's model", FEDAVG_COMMUNICATION,
        "its true cluster's model (the reference: no real method knows the cluster)",
        "`OracleStrategy.evaluate_parameters`", "true cluster",
        "is told: from round D it serves, and averages into, the model of the cluster whose data the client now holds",
        server_state=True,
    )  # fmt: skip
FACTS_IFCA = Facts(
        "evaluates all K models on its training data, trains the lowest-loss one",
        "each model = average of the clients that chose it", "the model it chose", "K models down, 1 up",
        "all K cluster models; it takes the one with the lowest loss on its training data (IFCA's cluster identity "
        "step)", "`IfcaClient.newcomer_model`", "lowest-loss cluster",
        "re-selects: every round it takes the cluster model with the lowest loss on the data it now holds",
        server_state=True,
    )  # fmt: skip
FACTS_DITTO = Facts(
        "trains the global model (returned) and a personal model with loss + (lambda/2)·‖w \u2212 w_global‖²", "FedAvg",
        "personal model", FEDAVG_COMMUNICATION,
        "the global model (a newcomer has no personal model; `newcomer-steps` stands for its personal fine-tuning)",
        "`FedcondClient.newcomer_model`", "global",
        "keeps its personal model, trained on the old data, and goes on training it on the new",
    )  # fmt: skip
FACTS_GOSSIP = Facts(
        "trains its own model", "simulates the network: a random matching each round, each pair averages",
        "own model", "2 models per pair, peer to peer",
        "one training client's model, drawn anew each round by a generator seeded with (seed, round, partition): its "
        "one random peer", "`GossipStrategy.newcomer_parameters`", "random peer", KEEPS_MODEL_ON_DRIFT,
        server_state=True,
    )  # fmt: skip
FACTS_DAC = Facts(
        "trains its own model", "simulates the network: each client averages with its top-k peers by cosine "
        "similarity", "own model", "k models received per client",
        "every training client's model; it averages (uniformly) the `dac-neighbours` with the lowest loss on its own "
        "training data. A newcomer has no model of its own to compare by cosine similarity, so this is the similarity "
        "of Listo Zec et al.'s original DAC (a peer model's training loss on the client's data), with the paper's "
        "top-k", "`DacStrategy.newcomer_parameters`, `DacClient.newcomer_model`", "lowest-loss peers",
        KEEPS_MODEL_ON_DRIFT,
        server_state=True,
    )  # fmt: skip
FACTS_FEDPROX = Facts(
        "trains the global model with loss + (mu/2)·‖w \u2212 w_global‖² (Li et al. 2020; not in the paper)", "FedAvg",
        "global model", FEDAVG_COMMUNICATION, *GLOBAL_NEWCOMER, NOTHING_ON_DRIFT,
    )  # fmt: skip
FACTS_DESCRIPTOR_CLUSTERING = Facts(
        "sends its fingerprint once, before round 1; trains its cluster's model (FLUX-style; not in the paper)",
        "DBSCAN on the descriptors finds the clusters (K not given), FedAvg within each", "its cluster's model",
        "as FedAvg, plus one descriptor per client",
        "the model of the cluster whose centroid is nearest the descriptor it sends before round 1 (label-free with "
        "`fingerprint = \"eigen-x\"`; [baselines.md](baselines.md))", "`DescriptorClusteringStrategy.place`",
        "nearest descriptor",
        "keeps the cluster its descriptor placed it in before round 1 (descriptors are sent once)",
        server_state=True,
    )  # fmt: skip
FACTS_CFL = Facts(
        "trains its cluster's model, as FedAvg's client (Sattler et al. 2020; not in the paper)",
        "one cluster, split in two by the cosine similarity of the clients' updates when FedAvg there is stationary "
        "but suits none (K not given)", "its cluster's model", "as FedAvg; a newcomer its parameter tree",
        "the leaf of the parameter tree its own updates lead it to: at each split on its way it trains the split's "
        "model and follows the side whose clients' updates its own agrees with ([baselines.md](baselines.md#cfl))",
        "`CflStrategy.evaluate_parameters`, `CflClient`, `fedcond/parameter_tree.py`", "split tree",
        "keeps the cluster it was split into (CFL splits, it never merges or moves a client)",
        server_state=True,
    )  # fmt: skip
FACTS_PFEDHN = Facts(
        "trains the model the server generated for it, as FedAvg's client (Shamsian et al. 2021; not in the paper)",
        "a hypernetwork maps each client's learned embedding to its model, stepped with each client's update",
        "its generated model", "as FedAvg; a newcomer 2k models more with `newcomer-steps=k`",
        "zero-shot, the model the hypernetwork generates from the mean of the training clients' embeddings; with "
        "`newcomer-steps = k`, the model of an embedding of its own learned in k exchanges with the hypernetwork "
        "frozen (the paper's novel clients; [baselines.md](baselines.md#pfedhn)), scored as its adapted accuracy",
        "`PFedHNStrategy.learn_newcomer_embeddings`, `PFedHNClient`", "mean embedding",
        "keeps its embedding, which goes on learning from its updates on the new data",
        server_state=True,
    )  # fmt: skip


@functools.cache
def registry() -> dict[str, Method]:
    """Every method by name, in the order reports list them."""
    methods = (
        Method("fedavg", "one global backbone CNN, FedAvg over all clients", FEDAVG, own_facts=FACTS_FEDAVG),
        Method("conditional", "one global CNN fed each client's fingerprint", CONDITIONAL,
               own_facts=FACTS_CONDITIONAL),
        # Not the paper's method: its named variants (docs/instability.md), never swapped in silently.
        *(Method(name, variant.summary, CONDITIONAL, variant_of=variant.base, fixed_settings=variant.settings)
          for name, variant in VARIANTS.items()),
        Method("local", "each client trains only its own model", "strategies.local:LocalStrategy",
               own_facts=FACTS_LOCAL),
        Method("oracle", "FedAvg within each true cluster (reference)", "strategies.cluster_models:OracleStrategy",
               own_facts=FACTS_ORACLE),
        Method("ifca", "K models, each client trains its lowest-loss one", "strategies.cluster_models:IfcaStrategy",
               own_facts=FACTS_IFCA),
        Method("ditto", "personal models pulled towards FedAvg's", FEDAVG, own_facts=FACTS_DITTO),
        Method("gossip", "random pairwise averaging of per-client models", "strategies.peer:GossipStrategy",
               own_facts=FACTS_GOSSIP),
        Method("dac", "averaging with the top-k cosine-similar peers", "strategies.peer:DacStrategy",
               own_facts=FACTS_DAC),
        # Beyond the paper: the competitors a reviewer asks about (docs/baselines.md).
        Method("fedprox", "FedAvg with each client's training pulled towards the global model", FEDAVG,
               competitor=True, own_facts=FACTS_FEDPROX),
        Method("descriptor-clustering", "one model per cluster DBSCAN finds in the clients' descriptors (K not given)",
               "strategies.cluster_models:DescriptorClusteringStrategy", competitor=True,
               own_facts=FACTS_DESCRIPTOR_CLUSTERING),
        Method("cfl", "clusters split recursively by the cosine similarity of the clients' updates (K not given)",
               "strategies.cfl:CflStrategy", competitor=True, own_facts=FACTS_CFL),
        Method("pfedhn", "a server-side hypernetwork generates each client's model from its learned embedding",
               "strategies.pfedhn:PFedHNStrategy", competitor=True, own_facts=FACTS_PFEDHN),
        # The paper's own protocol, centrally pooled (a reference, not a federated method): fedcond.pooled.
        *(Method(name, spec.summary, None, "pooled", spec.conditioned) for name, spec in POOLED_METHODS.items()),
    )  # fmt: skip
    return {method.name: method for method in methods}


def get_method(name: str) -> Method:
    """The registered method ``name``, or a one-line error listing the known ones."""
    methods = registry()
    if name not in methods:
        raise FedcondError(f"unknown method '{name}'; choose one of {', '.join(methods)}")
    return methods[name]


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


def global_model_methods() -> list[str]:
    """The methods (named variants aside) whose server averages one global model: what Flower's DP
    wrappers clip and noise."""
    from strategies.fedavg import FedcondFedAvg

    return [
        name
        for name, method in registry().items()
        if not method.variant_of and method.strategy is not None and issubclass(method.strategy, FedcondFedAvg)
    ]


def federated(method: Method) -> tuple[type[Any], type[FedcondStrategy]]:
    """The method's client and strategy classes; Flower runs only federated methods."""
    if method.client_path is None or method.strategy_path is None:
        raise FedcondError(
            f"{method.name} is the paper's centrally pooled protocol, not a federation; run it with "
            "fedcond run, compare or sweep (they train it in-process), not with flwr run"
        )
    return method.client, method.strategy
