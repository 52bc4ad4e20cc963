"""The method registry: a method is a client behaviour paired with a strategy, found by name.

Adding a method is its client file and/or strategy file plus one line in ``registry()``; the
method's own settings (``options``) and whether it serves held-out clients are declared on its
classes, next to the code that reads them. ``check_run`` is the one place a run is checked before
anything starts: every entry point (the ServerApp, ``fedcond run``, compare, sweep, deploy-local,
export-partitions) calls it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clients.conditional_client import ConditionalClient
from clients.ditto_client import DittoClient
from clients.fedcond_client import FedcondClient
from clients.ifca_client import IfcaClient
from clients.local_client import LocalClient
from fedcond import privacy, secure_aggregation
from fedcond.checkpoint import RESUME, check_resume, resume_folder
from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.pooled import POOLED_METHODS
from fedcond.scenarios import scenario_for, validate_without_data
from strategies import client_dp
from strategies.base import FedcondStrategy
from strategies.cluster_models import IfcaStrategy, OracleStrategy
from strategies.conditional import ConditionalFedAvg
from strategies.fedavg import FedcondFedAvg
from strategies.local import LocalStrategy
from strategies.peer import DacStrategy, GossipStrategy


@dataclass(frozen=True)
class Method:
    """A named pairing: how each client behaves and which strategy the server runs."""

    name: str
    summary: str
    #: None for the pooled references, which train centrally, in-process, without Flower.
    client: type[FedcondClient] | None
    strategy: type[FedcondStrategy] | None
    #: Whether the model is fed the client's fingerprint: a federated method's client class says so
    #: (``ConditionalClient``); a pooled one's entry.
    conditioned: bool = False
    #: "federated" (Flower rounds) or "pooled" (the paper's centralised protocol, ``fedcond.pooled``).
    protocol: str = "federated"
    #: A named variant: the method it runs (``variant_of``) and the settings it fixes on top of it.
    variant_of: str = ""
    fixed_settings: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.client is not None:  # one source: the client class that feeds (or not) the fingerprint
            object.__setattr__(self, "conditioned", self.client.conditioned)

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
    def serves_held_out_clients(self) -> bool:
        if self.strategy is None:  # pooled: a newcomer gets the pooled model (or its true cluster's)
            return self.protocol == "pooled"
        return self.strategy.serves_held_out_clients


@functools.cache
def registry() -> dict[str, Method]:
    """Every method by name, in the order reports list them."""
    methods = (
        Method("fedavg", "one global backbone CNN, FedAvg over all clients", FedcondClient, FedcondFedAvg),
        Method("conditional", "one global CNN fed each client's fingerprint", ConditionalClient, ConditionalFedAvg),
        # Not the paper's method: a named variant of it (docs/instability.md), never swapped in silently.
        Method(
            "recommended", "conditional with a label-aware fingerprint generating the output layer",
            ConditionalClient, ConditionalFedAvg, variant_of="conditional",
            fixed_settings=(("fingerprint", "class-mean"), ("conditioning", "hyper")),
        ),
        Method("local", "each client trains only its own model", LocalClient, LocalStrategy),
        Method("oracle", "FedAvg within each true cluster (reference)", FedcondClient, OracleStrategy),
        Method("ifca", "K models, each client trains its lowest-loss one", IfcaClient, IfcaStrategy),
        Method("ditto", "personal models pulled towards FedAvg's", DittoClient, FedcondFedAvg),
        Method("gossip", "random pairwise averaging of per-client models", FedcondClient, GossipStrategy),
        Method("dac", "averaging with the top-k cosine-similar peers", FedcondClient, DacStrategy),
        # The paper's own protocol, centrally pooled (a reference, not a federated method): fedcond.pooled.
        *(Method(name, spec.summary, None, None, spec.conditioned, "pooled") for name, spec in POOLED_METHODS.items()),
    )  # fmt: skip
    return {method.name: method for method in methods}


def get_method(name: str) -> Method:
    """The registered method ``name``, or a one-line error listing the known ones."""
    methods = registry()
    if name not in methods:
        raise FedcondError(f"unknown method '{name}'; choose one of {', '.join(methods)}")
    return methods[name]


#: Settings of a run rather than of a method, declared next to the code that reads them.
RUN_OPTIONS = (RESUME,)


def declared_options() -> tuple[Option, ...]:
    """Every method's options, each once (methods may share a class), the privacy settings every
    federated method has (sample-level: fedcond.privacy; client-level: strategies.client_dp; secure
    aggregation: fedcond.secure_aggregation), and the run's own."""
    unique = {option.key: option for method in registry().values() for option in method.options}
    shared = (*privacy.OPTIONS, *client_dp.OPTIONS, *secure_aggregation.OPTIONS, *RUN_OPTIONS)
    unique.update({option.key: option for option in shared})
    return tuple(unique.values())


def run_config(mapping: Mapping[str, Any], explicit: Mapping[str, Any] | None = None) -> RunConfig:
    """A run configuration from run-config keys, the methods' own options and a named variant's
    fixed settings included; ``explicit`` are the keys the user gave (the rest are defaults)."""
    return RunConfig.from_mapping(with_variant_settings(mapping, explicit), declared_options())


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


def method_names(selection: str) -> list[str]:
    """``all``: every federated method of the paper's comparison; ``variants``: our named variants;
    ``pooled``: the pooled reference family."""
    if selection == "variants":
        return [name for name, method in registry().items() if method.variant_of]
    protocol = "pooled" if selection == "pooled" else "federated"
    return [name for name, method in registry().items() if method.protocol == protocol and not method.variant_of]


def held_out_methods() -> list[str]:
    """Federated methods (variants too) under which a client that never trains has a model to evaluate."""
    names = [*method_names("all"), *method_names("variants")]
    return [name for name in names if registry()[name].serves_held_out_clients]


def federated(method: Method) -> tuple[type[FedcondClient], type[FedcondStrategy]]:
    """The method's client and strategy classes; Flower runs only federated methods."""
    if method.client is None or method.strategy is None:
        raise FedcondError(
            f"{method.name} is the paper's centrally pooled protocol, not a federation; run it with "
            "fedcond run, compare or sweep (they train it in-process), not with flwr run"
        )
    return method.client, method.strategy


def check_run(config: RunConfig, load_data: bool = False) -> Method:
    """Every check a run has before anything starts; returns its method.

    ``RunConfig`` has already checked each value on its own; this checks how they fit together
    (dataset, scenario, encoder, method, held-out clients) and, with ``resume``, that the run it
    names can go on with these settings (``fedcond.checkpoint.check_resume``). With ``load_data`` it also reads and
    splits the data, so missing files or clients with too few samples stop the run here too.
    """
    validate_without_data(config)
    method = get_method(config.method)
    if config.held_out_clients and not method.serves_held_out_clients:
        supported = held_out_methods()
        raise FedcondError(
            f"held-out-clients has no meaning for {method.name} (a client that never trains has no model of its "
            f"own there); set held-out-clients=0 or use one of {', '.join(supported)} "
            f"(compare: --methods {','.join(supported)})"
        )
    check_privacy(config, method)
    if resume_folder(config) is not None:
        check_resume(config)
    if load_data:
        scenario_for(config)
    check_secure_aggregation(config, method)  # after the data: too many clients for the data says so first
    return method


def check_secure_aggregation(config: RunConfig, method: Method) -> None:
    """Secure aggregation (docs/privacy.md) against the method and the federation, in one line."""
    if method.strategy is not None:
        sums_statistics = method.conditioned and config.normalisation == "federated"
        refusal = method.strategy.secure_aggregation_refusal
        secure_aggregation.check_secure_aggregation(config, refusal, sums_statistics)
    elif secure_aggregation.SecureAggregation.of(config).model_updates:
        raise FedcondError(
            f"{method.name} trains centrally on pooled data: secure-aggregation applies to federated methods only; "
            "set secure-aggregation=none"
        )


def check_privacy(config: RunConfig, method: Method) -> None:
    """The DP settings (docs/privacy.md) against the method: refused in one line where they cannot hold."""
    sample_level = privacy.SampleLevelPrivacy.of(config)
    if method.protocol == "pooled" and (sample_level.enabled or client_dp.client_dp_mode(config) != "off"):
        raise FedcondError(
            f"{method.name} trains centrally on pooled data: the DP settings (dp-noise-multiplier, "
            "fingerprint-epsilon, client-dp) apply to federated methods only; set them to 0 / off"
        )
    if sample_level.dp_sgd and method.client is not None and not method.client.releases_only_trained_models:
        raise FedcondError(
            f"dp-noise-multiplier cannot make {method.name} private: its clients also send a choice computed "
            "from their training data, which DP-SGD does not cover; set dp-noise-multiplier=0 or pick another method"
        )
    if sample_level.enabled and resume_folder(config) is not None:
        raise FedcondError(
            "resume with sample-level DP (dp-noise-multiplier, fingerprint-epsilon): each client keeps its privacy "
            "ledger (and its noised fingerprint) in Flower's context.state, which a resumed run starts empty, so its "
            "epsilon would restart from 0; start the run again without resume"
        )
    privacy.check_sample_level(config, method.conditioned)
    client_dp.check_client_dp(config, method.strategy)
