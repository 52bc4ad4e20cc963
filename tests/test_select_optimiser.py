"""tools/select_optimiser.py: each competitor's server optimiser by the declared rule, from its folder."""

import csv
import json
import tomllib

from fedcond.tools.experiment import read_grid_file
from tools.select_optimiser import read_choices, table

GRID = """
title = "t"
paper-tables = []
[settings]
num-server-rounds = 3
[grid]
seed = [0]
method = ["fedavg"]
[profiles.e4b-competitors-select]
seed = [0]
method = [{ label = "ifca-fedavgm", method = "ifca", server-momentum = 0.5 }, "ifca", "dac"]
"""


def folder(tmp_path, finals: dict[str, float], rounds: int = 3, last: dict[str, int] | None = None):
    """A comparison folder whose seed-0 runs end at ``finals`` (validation); test accuracy runs the
    other way, and seed 1 is better still: the rule must read neither."""
    out = tmp_path / "e4b"
    out.mkdir()
    (out / "experiment.json").write_text(json.dumps({"kind": "sweep", "settings": {"num-server-rounds": rounds},
                                                     "axes": {"seed": [0, 1]}}))  # fmt: skip
    with (out / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["method", "seed", "round", "accuracy", "validation_accuracy"])
        writer.writeheader()
        for label, final in finals.items():
            for seed, shift in ((0, 0.0), (1, 0.5)):
                for number in range(1, (last or {}).get(label, rounds) + 1):
                    writer.writerow({"method": label, "seed": seed, "round": number, "accuracy": 1 - final,
                                     "validation_accuracy": min(1.0, final + shift)})  # fmt: skip
    grid = tmp_path / "grid.toml"
    grid.write_text(GRID)
    return read_choices(out, grid), grid


def test_the_higher_seed_0_validation_wins_and_the_profile_runs_it_at_seeds_1_and_2(tmp_path):
    choices, grid = folder(tmp_path, {"ifca": 0.80, "ifca-fedavgm": 0.82, "dac": 0.70})
    assert [choice.chosen() for choice in choices] == ["ifca-fedavgm", "dac"]
    printed = table(choices)
    profile = printed[printed.index("[profiles.e4b-competitors]") :]
    # The printed profile, pasted into the grid, runs exactly the chosen entries at seeds 1-2.
    grid.write_text(GRID + "\n" + profile + "\n")
    tomllib.loads(grid.read_text())
    experiment = read_grid_file(grid, "e4b-competitors")
    assert experiment.axes["seed"] == [1, 2]
    assert experiment.axes["method"] == [{"label": "ifca-fedavgm", "method": "ifca", "server-momentum": 0.5}, "dac"]


def test_an_exact_tie_keeps_the_plain_server_whichever_the_grid_lists_first(tmp_path):
    choices, _ = folder(tmp_path, {"ifca": 0.80, "ifca-fedavgm": 0.80, "dac": 0.70})
    assert choices[0].chosen() == "ifca"


def test_a_missing_or_unfinished_run_leaves_the_choice_pending_and_named(tmp_path):
    choices, _ = folder(tmp_path, {"ifca": 0.80, "ifca-fedavgm": 0.90}, last={"ifca-fedavgm": 2})
    assert choices[0].chosen() is None
    assert "Pending: 2 run(s) to come: ifca-fedavgm, dac." in table(choices)
