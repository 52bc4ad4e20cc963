"""Every setting, declared once, as one table: where Flower's ``[tool.flwr.app.config]`` and
docs/settings.md come from.

A setting is declared where it is owned: a ``RunConfig`` field (``fedcond.config.setting``: default,
topic and help in the field's metadata) or an ``Option`` next to the code that reads it (a method's
client or strategy class, the round protocol, the privacy and secure-aggregation modules, the run's
own). ``fedcond settings`` prints the table; ``fedcond settings --write`` regenerates the pyproject
block (Flower accepts no run-config key the app does not declare there) and docs/settings.md from it.
The tests keep both equal to what this module generates.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
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
PYPROJECT = Path("pyproject.toml")
BLOCK_START, BLOCK_END = "[tool.flwr.app.config]\n", "\n[tool.ruff]\n"
SETTINGS_PAGE = Path("docs", "settings.md")


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


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def pyproject_block() -> str:
    """``[tool.flwr.app.config]``: every key with its default, under its topic's heading."""
    lines, topic = ["[tool.flwr.app.config]"], None
    for row in settings():
        if row.topic != topic:
            topic = row.topic
            lines.append(f"# {TOPICS[topic]}.")
        lines.append(f"{row.key} = {_toml(row.default)}")
    return "\n".join(lines) + "\n"


def settings_markdown() -> str:
    """docs/settings.md: one table row per key, grouped by topic."""
    lines = [
        "# Settings",
        "",
        "<!-- generated by `fedcond settings --write` from the settings' declarations; do not edit -->",
        "",
        "Every key lives in `[tool.flwr.app.config]` of `pyproject.toml`; `fedcond run key=value ...`,",
        "`fedcond compare ... key=value`, grid files and `flwr run --run-config 'key=value ...'` override them.",
        "Unknown keys and wrong types are refused. Each setting is declared once, where it is owned (a",
        "`RunConfig` field with its help in the field's metadata, or an `Option` next to the code that reads it),",
        "and this page and the pyproject block are generated from those declarations (`fedcond settings --write`).",
    ]
    topic = None
    for row in settings():
        if row.topic != topic:
            topic = row.topic
            lines += ["", f"## {TOPICS[topic]}", "", "| key | default | for | meaning |", "|---|---|---|---|"]
        lines.append(f"| `{row.key}` | `{_toml(row.default)}` | {row.owner} | {row.help} |")
    lines += [
        "",
        "**Per-dataset training defaults.** The paper trains with batch 64 and one local epoch per round.",
        "On digits a client holds about 60 (K=3) or 36 (K=5) training samples: one batch of 64 per round",
        "learns nothing in 10 rounds (about 7% accuracy). Digits therefore defaults to 5 local epochs of",
        "batch 16; MNIST, Fashion-MNIST and CIFAR keep the paper's 1 x 64. `run.json` records the values used.",
    ]
    return "\n".join(lines) + "\n"


def replace_block(text: str) -> str:
    """``pyproject.toml``'s text with its ``[tool.flwr.app.config]`` block regenerated."""
    start = text.index(BLOCK_START)
    end = text.index(BLOCK_END, start)
    return text[:start] + pyproject_block() + text[end:]


def write(root: Path) -> list[Path]:
    """Regenerate the pyproject block, docs/settings.md and the method tables (``method_docs``)
    under ``root``; the files written."""
    from fedcond.tools.method_docs import regenerated

    method_pages = regenerated(root)  # every block found before anything is written
    pyproject = root / PYPROJECT
    pyproject.write_text(replace_block(pyproject.read_text()))
    (root / SETTINGS_PAGE).write_text(settings_markdown())
    for path, text in method_pages.items():
        path.write_text(text)
    return [pyproject, root / SETTINGS_PAGE, *method_pages]
