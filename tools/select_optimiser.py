"""Each E4b competitor's server optimiser, chosen by the like-for-like protocol's declared rule.

    python -m tools.select_optimiser experiments/results/like-for-like-e4b

``experiments/grids/like-for-like.toml`` declared, before its runs (step 4): each competitor runs at
seed 0 on plain FedAvg and with FedAvgM 0.5 (profile ``e4b-competitors-select``), and the one with
the higher final validation accuracy (the training clients' held-out split, ``validation_accuracy``)
runs its seeds 1-2; on an exact tie the plain server, the simpler. A method with one candidate (DAC:
no server average) runs as it is. Test accuracy is not read. Until every candidate has run all its
rounds at seed 0 the answer is "pending", naming the runs still missing. The choice is printed with
the ``e4b-competitors`` profile that runs it, for the grid file.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.tools.experiment import METRICS_FILE, load_experiment, read_grid_file
from tools import reported
from tools.claims import VALIDATION_COLUMN, metrics_rows, server_optimiser_name

GRID = Path("experiments/grids/like-for-like.toml")
#: The profile whose method bundles are the candidates, and the seed they ran at.
PROFILE, SEED = "e4b-competitors-select", "0"


@dataclass(frozen=True)
class Choice:
    method: str
    #: Candidate label -> its grid entry (a bundle, or the method's name).
    entries: Mapping[str, Mapping | str]
    #: Candidate label -> its final validation accuracy at the seed (None: not run to its last round).
    candidates: Mapping[str, float | None]
    #: Candidate label -> whether it changes the server optimiser (FedAvgM).
    optimised: Mapping[str, bool]

    def missing(self) -> list[str]:
        return [label for label, value in self.candidates.items() if value is None]

    def chosen(self) -> str | None:
        if self.missing():
            return None
        # The higher validation accuracy; on an exact tie the plain server (not optimised: True wins).
        return max(self.candidates, key=lambda label: (self.candidates[label], not self.optimised[label]))


def candidates_by_method(grid: Path = GRID, profile: str = PROFILE) -> dict[str, list[Mapping | str]]:
    """The profile's method entries (bundles, or a method's name), grouped by method."""
    grouped: dict[str, list[Mapping | str]] = {}
    for value in read_grid_file(grid, profile).axes["method"]:
        grouped.setdefault(str(value["method"] if isinstance(value, Mapping) else value), []).append(value)
    return grouped


def _bundle(entry: Mapping | str) -> Mapping:
    return entry if isinstance(entry, Mapping) else {"label": entry, "method": entry}


def toml_entry(entry: Mapping | str) -> str:
    """A method entry as a grid file writes it: a quoted name, or an inline table."""
    if isinstance(entry, str):
        return f'"{entry}"'
    cells = ", ".join(
        f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value}" for key, value in entry.items()
    )
    return "{ " + cells + " }"


def read_choices(folder: Path, grid: Path = GRID, profile: str = PROFILE) -> list[Choice]:
    """Each competitor's candidates' final validation accuracy at ``SEED`` in ``folder``."""
    rounds = int(load_experiment(folder).settings.get("num-server-rounds", RunConfig().num_server_rounds))
    rows = metrics_rows(folder) if (folder / METRICS_FILE).is_file() else []
    last: dict[str, tuple[int, float]] = {}
    for row in rows:
        if row.get("seed") != SEED:
            continue
        value = float(row.get(VALIDATION_COLUMN) or "nan")
        label, number = str(row["method"]), int(row["round"])
        if number >= last.get(label, (0, 0.0))[0]:
            last[label] = (number, value)
    choices = []
    for method, entries in candidates_by_method(grid, profile).items():
        bundles = [_bundle(entry) for entry in entries]
        finals: dict[str, float | None] = {}
        for bundle in bundles:
            number, value = last.get(str(bundle["label"]), (0, math.nan))
            if number == rounds and math.isnan(value):
                raise FedcondError(
                    f"{folder}: {bundle['label']} has no {VALIDATION_COLUMN}; run it with validation-fraction"
                )
            finals[str(bundle["label"])] = value if number == rounds else None
        optimised = {str(bundle["label"]): bool(server_optimiser_name(bundle)) for bundle in bundles}
        choices.append(Choice(method, {str(_bundle(entry)["label"]): entry for entry in entries}, finals, optimised))
    return choices


def table(choices: Sequence[Choice]) -> str:
    lines = ["| method | candidate | final validation, seed 0 | chosen |", "|---|---|---|---|"]
    for choice in choices:
        chosen = choice.chosen()
        for label, value in choice.candidates.items():
            cell = f"{value:.4f}" if value is not None else "-"
            lines.append(f"| {choice.method} | {label} | {cell} | {'yes' if label == chosen else ''} |")
    missing = [label for choice in choices for label in choice.missing()]
    if missing:
        return "\n".join([*lines, "", f"Pending: {len(missing)} run(s) to come: {', '.join(missing)}."])
    entries = [f"    {toml_entry(choice.entries[str(choice.chosen())])}," for choice in choices]
    return "\n".join([*lines, "", "[profiles.e4b-competitors]", 'extends = "e4b-competitors-select"', "seed = [1, 2]",
                      "method = [", *entries, "]"])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the E4b comparison's folder (experiments/results/like-for-like-e4b)")
    parser.add_argument("--grid", type=Path, default=GRID, help=f"the grid declaring the candidates ({GRID})")
    args = parser.parse_args(argv)
    return reported("select_optimiser", lambda: print(table(read_choices(args.folder, args.grid))))


if __name__ == "__main__":
    raise SystemExit(main())
