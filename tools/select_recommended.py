"""The like-for-like selection's rule, applied to its sweep folder: which candidate becomes `recommended`.

    python -m tools.select_recommended experiments/results/like-for-like

The rule is the one ``experiments/grids/like-for-like.toml`` declared before its runs (and
docs/comparisons.md says in prose): each candidate's score is the mean, over the grid's settings, of
its final-round validation accuracy at the selection's seed (``validation_accuracy`` in metrics.csv,
the training clients'; a run short of its rounds counts as missing); the best score wins, except
that a candidate within ``MARGIN`` of the best loses to a simpler one, simpler meaning fewer of
``EXTRAS`` changed from their defaults (no head fit, no server momentum); among equally simple
candidates within the margin the higher score wins. Test accuracy is not read. Until every candidate
has run on every setting the answer is "pending", with the runs still missing.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedcond.errors import FedcondError
from tools import reported
from tools.claims import VALIDATION_COLUMN

#: Within this much (accuracy, 0.1 points) of the best score a simpler candidate wins.
MARGIN = 0.001
#: The settings that add machinery beyond the conditioning itself, with their defaults: each changed
#: one makes a candidate less simple.
EXTRAS: Mapping[str, object] = {"head-fit": "average", "server-momentum": 0.0}
#: The metrics.csv column the choice reads.
COLUMN = VALIDATION_COLUMN


@dataclass(frozen=True)
class Candidate:
    label: str
    extras: int
    #: Final-round validation accuracy by setting label (only the settings that have run).
    finals: Mapping[str, float]

    def score(self, settings: Sequence[str]) -> float:
        return sum(self.finals[setting] for setting in settings) / len(settings)


@dataclass(frozen=True)
class Selection:
    settings: tuple[str, ...]
    candidates: tuple[Candidate, ...]

    def missing(self) -> list[str]:
        """The runs still to come, as 'candidate on setting'."""
        return [f"{candidate.label} on {setting}" for candidate in self.candidates for setting in self.settings
                if setting not in candidate.finals]  # fmt: skip

    def chosen(self) -> Candidate | None:
        """The rule's choice; None while runs are missing."""
        if self.missing():
            return None
        best = max(candidate.score(self.settings) for candidate in self.candidates)
        close = [candidate for candidate in self.candidates if candidate.score(self.settings) >= best - MARGIN]
        return min(close, key=lambda candidate: (candidate.extras, -candidate.score(self.settings)))

    def table(self) -> str:
        """The scores as a Markdown table, the choice under it."""
        lines = [
            "| candidate | extras | " + " | ".join(self.settings) + " | mean |",
            "|---|---|" + "---|" * (len(self.settings) + 1),
        ]
        for candidate in self.candidates:
            cells = [f"{candidate.finals[s]:.4f}" if s in candidate.finals else "-" for s in self.settings]
            mean = f"{candidate.score(self.settings):.4f}" if len(candidate.finals) == len(self.settings) else "-"
            lines.append(f"| {candidate.label} | {candidate.extras} | " + " | ".join(cells) + f" | {mean} |")
        chosen = self.chosen()
        if chosen is None:
            missing = self.missing()
            lines += ["", f"Pending: {len(missing)} run(s) to come: " + "; ".join(missing) + "."]
        else:
            lines += ["", f"Chosen: {chosen.label} (mean final validation {chosen.score(self.settings):.4f})."]
        return "\n".join(lines)


def extras_of(bundle: Mapping[str, object]) -> int:
    return sum(1 for key, default in EXTRAS.items() if key in bundle and bundle[key] != default)


def read_selection(folder: Path) -> Selection:
    """The selection of a sweep folder: its experiment.json's settings and method bundles, and each
    run's final ``COLUMN`` from its metrics.csv."""
    try:
        experiment = json.loads((folder / "experiment.json").read_text())
        axes, settings = experiment["axes"], experiment.get("settings", {})
        setting_labels = tuple(str(setting["label"]) for setting in axes["setting"])
        bundles = [bundle for bundle in axes["method"] if isinstance(bundle, dict)]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as error:
        raise FedcondError(f"{folder} is no sweep folder with labelled settings and methods ({error})") from None
    if len(axes.get("seed", [])) != 1:
        raise FedcondError(f"{folder}: the selection runs one seed, this sweep ran {axes.get('seed')}")
    rounds = {str(setting["label"]): int(setting.get("num-server-rounds", settings.get("num-server-rounds", 0)))
              for setting in axes["setting"]}  # fmt: skip
    finals: dict[tuple[str, str], tuple[int, float]] = {}
    metrics = folder / "metrics.csv"
    if metrics.exists():
        with metrics.open(newline="") as handle:
            for row in csv.DictReader(handle):
                key, round_number = (row["setting"], row["method"]), int(row["round"])
                value = float(row.get(COLUMN) or "nan")
                if math.isnan(value):
                    raise FedcondError(
                        f"{metrics}: {key[1]} on {key[0]} has no {COLUMN}: run it with validation-fraction"
                    )
                if round_number >= finals.get(key, (0, 0.0))[0]:
                    finals[key] = (round_number, value)
    candidates = tuple(
        Candidate(
            str(bundle["label"]),
            extras_of(bundle),
            {setting: finals[(setting, str(bundle["label"]))][1] for setting in setting_labels
             if finals.get((setting, str(bundle["label"])), (0, 0.0))[0] == rounds[setting]},
        )
        for bundle in bundles
    )  # fmt: skip
    return Selection(setting_labels, candidates)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the selection's sweep folder (experiments/results/like-for-like)")
    args = parser.parse_args(argv)
    return reported("select_recommended", lambda: print(read_selection(args.folder).table()))


if __name__ == "__main__":
    sys.exit(main())
