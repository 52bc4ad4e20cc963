"""Every setting, declared once, as one table: what a run defaults to, and where Flower's
``[tool.flwr.app.config]`` and docs/settings.md come from.

A setting is declared where it is owned: a ``RunConfig`` field (``fedcond.config.setting``: default,
topic and help in the field's metadata) or an ``Option`` next to the code that reads it (a method's
client or strategy class, the round protocol, the privacy and secure-aggregation modules, the run's
own). ``fedcond settings`` prints the table. From a checkout, ``python -m tools.docs`` (tools/docs.py,
not installed) regenerates the pyproject block (Flower accepts no run-config key the app does not
declare there) and docs/settings.md from it; the tests keep both equal to what it generates.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

from fedcond.config import Option, RunConfig

# The topics in the order the pyproject block and the table list them, with their headings.
TOPICS = {
    "run": "What runs: method, data, federation, rounds, seed",
    "scenario": "Scenario details",
    "training": "Local training and the network",
    "fingerprint": "The fingerprint and how the model takes it",
    "files": "Where things are, what is printed",
    "methods": "The methods' own settings (declared on their client or strategy classes)",
    "protocol": "The round protocol: waiting for nodes, answers each round needs, time limits",
    "server-optimiser": (
        "The server optimiser: FedAvgM on each model a server averages (a method that averages none refuses it)"
    ),
    "privacy": "Differential privacy (privacy.md): sample-level DP-SGD and DP fingerprint, client-level DP",
    "secure-aggregation": "Secure aggregation (privacy.md): Flower's SecAgg+ for model updates; its protocol values",
    "newcomers": "Newcomers (newcomers.md): what held-out clients are served, and their adaptation",
    "evaluation": "Evaluation beyond each client's accuracy (tabular.md: the per-character table)",
    "resume": "Resume (deployment.md)",
}


@dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    topic: str
    owner: str
    help: str


def setting_choices(field: dataclasses.Field) -> list[str]:
    """The values a run setting takes, read from its one table (``setting(choices=...)``); none: free."""
    if not field.metadata.get("choices"):
        return []
    module, _, table = field.metadata["choices"].partition(":")
    return list(getattr(importlib.import_module(module), table))


def run_setting_help(field: dataclasses.Field) -> str:
    """A run setting's help, ending in the values its table holds."""
    choices = setting_choices(field)
    listed = "; one of " + ", ".join(f"`{choice}`" for choice in choices) if choices else ""
    return field.metadata["help"] + listed


def settings() -> list[Setting]:
    """Every run-config key, in the order of ``TOPICS`` (within one, in declaration order)."""
    from fedcond.federation.methods import registry, shared_options
    from fedcond.federation.strategy import FedcondStrategy

    rows = [
        Setting(field.name.replace("_", "-"), field.default, field.metadata["topic"], "run", run_setting_help(field))
        for field in dataclasses.fields(RunConfig)
        if field.name != "options"
    ]
    owners: dict[str, list[str]] = {}
    options: dict[str, Option] = {}
    protocol_options = FedcondStrategy.protocol_options
    protocol = {option.key for option in protocol_options}
    for method in registry().values():
        for option in method.options:
            if option.key not in protocol:
                owners.setdefault(option.key, []).append(method.variant_of or method.name)
                options[option.key] = option
    rows += [
        Setting(key, o.default, "methods", ", ".join(dict.fromkeys(owners[key])), o.help) for key, o in options.items()
    ]
    rows += [Setting(o.key, o.default, "protocol", "every federated method", o.help) for o in protocol_options]
    rows += [
        Setting(o.key, o.default, group.topic, group.owner, o.help) for group in shared_options() for o in group.options
    ]
    order = list(TOPICS)
    return sorted(rows, key=lambda row: order.index(row.topic))
