"""The method table: every method by name, built from what each method declares about itself.

A federated method is two files found by its name, as FL-bench finds a method's: ``Client`` in
``clients/<method>.py`` (``fedcond.variants.client_path``: the ClientApp finds it the same way,
without this table) and ``METHOD = Declaration(...)`` in ``strategies/<method>.py`` (its summary,
strategy class and ``Facts``, ``fedcond.federation.declaration``). The method's own settings (``options``)
and whether it serves held-out clients are declared on its classes, next to the code that reads
them. Named variants come from ``fedcond.variants``, the pooled references from ``fedcond.pooled``.
How settings fit together, before anything starts, is ``fedcond.federation.checks``.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.declaration import Declaration, Facts
from fedcond.model.server_optimiser import POOLED_REFUSAL
from fedcond.model.store import CLIENT_STATE_DIR
from fedcond.pooled import POOLED_METHODS, not_a_federation
from fedcond.records.history import CHECKPOINT_EVERY, RESUME
from fedcond.records.live_curves import LIVE_CURVES
from fedcond.shared_options import CLIENT_SHARED, EVERY_METHOD, SERVER_OPTIMISER, SharedOptions
from fedcond.variants import RETIRED, VARIANTS, client_path, with_variant_settings

if TYPE_CHECKING:
    from fedcond.federation.server_method import ServerMethod


@functools.cache
def load_class(path: str) -> type:
    """``module:Class``, imported now."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Method:
    """A named pairing: how each client behaves and which strategy the server runs.

    ``strategy`` is None for the pooled references, which train centrally, in-process, without
    Flower; ``client`` imports the method's client class when asked.
    """

    name: str
    summary: str
    strategy: type[ServerMethod] | None
    #: "federated" (Flower rounds) or "pooled" (the paper's centralised protocol, ``fedcond.pooled``).
    protocol: str = "federated"
    #: A pooled reference's model takes the fingerprint (a federated method's client class says so).
    pooled_conditioned: bool = False
    #: A named variant: the method it runs (``variant_of``) and the settings it fixes on top of it.
    variant_of: str = ""
    fixed_settings: tuple[tuple[str, Any], ...] = ()
    #: What the tests that run every method add to their settings for this one (``Declaration``).
    test_settings: tuple[tuple[str, Any], ...] = ()
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
        """The client class (a ``fedcond.federation.client.FedcondClient``; found by the method's name,
        so that nothing in ``strategies/`` imports ``clients/``)."""
        return load_class(self.client_path) if self.client_path else None

    @property
    def conditioned(self) -> bool:
        """Whether the model is fed the client's fingerprint: one source, the client class that feeds
        it (``ConditionalClient``), or the pooled reference's entry."""
        client = self.client
        return client.conditioned if client is not None else self.pooled_conditioned

    @property
    def options(self) -> tuple[Option, ...]:
        """The method's own settings and, for a federated method, the round protocol's. A client that
        keeps arrays between rounds (``state_lost_on_resume``) can keep them in files instead of
        Flower's in-memory ``context.state``: ``client-state-dir``."""
        own = tuple(option for part in (self.client, self.strategy) if part is not None for option in part.options)
        keeps = (CLIENT_STATE_DIR,) if self.state_lost_on_resume else ()
        if self.strategy is None:
            return own + keeps
        from fedcond.federation.strategy import FedcondStrategy

        return own + keeps + FedcondStrategy.protocol_options

    @property
    def state_lost_on_resume(self) -> str:
        """What a resumed run of this method starts afresh (kept on clients, not in the checkpoint)."""
        return self.client.state_lost_on_resume if self.client is not None else ""

    @property
    def server_step_refusal(self) -> str | None:
        """Why its server has no average for a server optimiser to step (its strategy's reason, or the
        pooled protocol's); None: it has one (``server-momentum`` applies)."""
        return self.strategy.server_step_refusal if self.strategy is not None else POOLED_REFUSAL

    @property
    def needs_true_clusters(self) -> bool:
        """Whether the method is told the true clusters (Oracle, pooled-oracle): a reference, not a method."""
        if self.strategy is None:
            return POOLED_METHODS[self.variant_of or self.name].scope == "cluster"
        return self.strategy.uses_true_clusters

    @property
    def serves_held_out_clients(self) -> bool:
        if self.strategy is None:  # pooled: a newcomer gets the pooled model (or its true cluster's)
            return self.protocol == "pooled"
        return self.strategy.serves_held_out_clients


def method_modules() -> list[str]:
    """Every federated method, by the name of its two modules (``strategies/<module>.py`` holds
    ``METHOD``, ``clients/<module>.py`` holds ``Client``), found by import: every module of the
    strategies package, in name order; a method's name is its module's with ``-`` for ``_``. Nothing
    lists them, so adding a method is adding its modules; a module there that declares no method is
    refused at start naming its file (``checked_declaration``), never skipped."""
    from fedcond import strategies

    return sorted(info.name for info in pkgutil.iter_modules(strategies.__path__))


def method_module(module: str) -> ModuleType:
    """``fedcond.strategies.<module>``, imported, or a one-line error naming its file."""
    try:
        return importlib.import_module(f"fedcond.strategies.{module}")
    except ImportError as error:
        raise FedcondError(f"strategies/{module}.py cannot be imported: {error}") from error


def checked_declaration(module: str) -> Declaration:
    """The ``METHOD`` of ``strategies/<module>.py``, checked: a Declaration of a strategy class."""
    from fedcond.federation.server_method import ServerMethod

    declaration = getattr(method_module(module), "METHOD", None)
    where = f"strategies/{module}.py"
    if not isinstance(declaration, Declaration):
        what = "missing" if declaration is None else f"a {type(declaration).__name__}"
        raise FedcondError(f"{where}: METHOD is {what}, not Declaration(...); every method module declares one")
    if not (isinstance(declaration.strategy, type) and issubclass(declaration.strategy, ServerMethod)):
        raise FedcondError(f"{where}: METHOD's strategy {declaration.strategy!r} is no ServerMethod subclass")
    if not isinstance(declaration.facts, Facts):
        raise FedcondError(f"{where}: METHOD's facts are a {type(declaration.facts).__name__}, not Facts(...)")
    if not declaration.facts.releases:
        raise FedcondError(
            f"{where}: METHOD's facts declare no releases; say what its client sends (Facts(releases=(Release(...),)), "
            "fedcond/federation/declaration.py)"
        )
    return declaration


@functools.cache
def declared_methods() -> dict[str, Declaration]:
    """Every federated method's declaration, by name, in module-name order: each one's ``METHOD``,
    checked, or a one-line error naming the file at fault."""
    return {module.replace("_", "-"): checked_declaration(module) for module in method_modules()}


@functools.cache
def registry() -> dict[str, Method]:
    """Every method by name, in the order reports list them: the paper's methods, then each named
    variant after its base method, the competitors, and the pooled references."""
    declared = declared_methods()
    for name, variant in VARIANTS.items():
        if variant.base not in declared:
            raise FedcondError(f"variant {name} is of {variant.base}, which no strategies/*.py declares")

    def entries(name: str, declaration: Declaration) -> list[Method]:
        strategy = declaration.strategy
        tested_with = tuple(declaration.test_settings.items())
        own = Method(
            name, declaration.summary, strategy, competitor=declaration.competitor, own_facts=declaration.facts,
            test_settings=tested_with,
        )  # fmt: skip
        variants = [
            Method(
                variant_name,
                variant.summary,
                strategy,
                variant_of=name,
                fixed_settings=variant.settings,
                test_settings=tested_with,
            )
            for variant_name, variant in VARIANTS.items()
            if variant.base == name
        ]
        return [own, *variants]

    methods = (
        *(entry for name, declaration in declared.items() if not declaration.competitor
          for entry in entries(name, declaration)),
        *(entry for name, declaration in declared.items() if declaration.competitor
          for entry in entries(name, declaration)),
        # The paper's own protocol, centrally pooled (a reference, not a federated method): fedcond.pooled.
        *(Method(name, spec.summary, None, "pooled", spec.conditioned) for name, spec in POOLED_METHODS.items()),
    )  # fmt: skip
    return {method.name: method for method in methods}


def get_method(name: str) -> Method:
    """The registered method ``name``, or a one-line error listing the known ones."""
    methods = registry()
    if name in RETIRED:
        raise FedcondError(f"method={name} is no longer a method name: run {RETIRED[name]} (docs/comparisons.md)")
    if name not in methods:
        raise FedcondError(f"unknown method '{name}'; choose one of {', '.join(methods)}")
    return methods[name]


def shared_options() -> tuple[SharedOptions, ...]:
    """Every shared setting: the clients' (``CLIENT_SHARED``), the server optimiser of every method
    whose server averages a model (``SERVER_OPTIMISER``), the server's client-level DP
    (fedcond.federation.client_dp, imported here: a ClientApp never needs it) and the run's own (resume)."""
    from fedcond.federation import client_dp

    return (
        *CLIENT_SHARED,
        SERVER_OPTIMISER,
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
    options = declared_options()
    defaults = {option.key: option.default for option in options}
    return RunConfig.from_mapping(with_variant_settings(mapping, explicit, defaults), options)


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


def client_dp_methods() -> list[str]:
    """The methods (named variants aside) that client-level DP can serve: a server that averages one
    global model (Flower's DP wrappers), or one per true cluster (``client_dp_per_model``)."""
    return [
        name
        for name, method in registry().items()
        if not method.variant_of
        and method.strategy is not None
        and (method.strategy.averages_one_model or method.strategy.client_dp_per_model)
    ]


def federated(method: Method) -> tuple[type[Any], type[ServerMethod]]:
    """The method's client and strategy classes; Flower runs only federated methods."""
    if method.client_path is None or method.strategy is None:
        raise not_a_federation(method.name)
    return method.client, method.strategy
