"""tools/select_recommended.py: the like-for-like selection's declared rule, applied to a sweep folder."""

import csv
import json

import pytest

from fedcond.errors import FedcondError
from tools.select_recommended import read_selection

SETTINGS = ["A", "B"]
BUNDLES = [
    {"label": "plain", "method": "scaled-hyper"},
    {"label": "momentum", "method": "scaled-hyper", "server-momentum": 0.5},
    {"label": "ridge-momentum", "method": "scaled-hyper", "head-fit": "ridge", "server-momentum": 0.5},
]


def sweep(tmp_path, finals: dict[tuple[str, str], float], rounds: int = 3, last: dict | None = None):
    """A selection folder: experiment.json and metrics.csv with ``rounds`` rounds a run (``last`` a
    run's last round where it stopped early); each run's final validation from ``finals``."""
    axes = {"setting": [{"label": s, "dataset": "digits"} for s in SETTINGS], "seed": [0], "method": BUNDLES}
    (tmp_path / "experiment.json").write_text(json.dumps({"kind": "sweep", "settings": {"num-server-rounds": rounds},
                                                          "axes": axes}))  # fmt: skip
    with (tmp_path / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["setting", "method", "seed", "round", "accuracy", "validation_accuracy"])
        writer.writeheader()
        for (setting, label), final in finals.items():
            for round_number in range(1, (last or {}).get((setting, label), rounds) + 1):
                # Test accuracy rises against validation: the rule must not read it.
                validation = final - 0.01 * (rounds - round_number)
                writer.writerow({"setting": setting, "method": label, "seed": 0, "round": round_number,
                                 "accuracy": 1 - final, "validation_accuracy": validation})  # fmt: skip
    return read_selection(tmp_path)


def everything(plain: float, momentum: float, ridge: float) -> dict[tuple[str, str], float]:
    return {(s, label): value for s in SETTINGS
            for label, value in (("plain", plain), ("momentum", momentum), ("ridge-momentum", ridge))}  # fmt: skip


def test_the_best_mean_final_validation_wins_when_clear_of_the_margin(tmp_path):
    selection = sweep(tmp_path, everything(0.90, 0.92, 0.95))
    assert selection.chosen().label == "ridge-momentum"
    assert "Chosen: ridge-momentum (mean final validation 0.9500)" in selection.table()


def test_within_a_tenth_of_a_point_the_simpler_candidate_wins(tmp_path):
    # ridge-momentum is best by 0.05 points: plain (no extras) is within the margin and simpler.
    selection = sweep(tmp_path, everything(0.9500, 0.9502, 0.9505))
    assert selection.chosen().label == "plain"
    # 0.2 points behind: no longer within it; momentum (one extra) is, and beats ridge's two.
    assert sweep(tmp_path, everything(0.9480, 0.9497, 0.9500)).chosen().label == "momentum"


def test_a_missing_or_unfinished_run_leaves_the_choice_pending_and_named(tmp_path):
    finals = everything(0.90, 0.92, 0.95)
    del finals[("B", "plain")]
    selection = sweep(tmp_path, finals, last={("A", "momentum"): 2})
    assert selection.chosen() is None
    assert selection.missing() == ["plain on B", "momentum on A"]
    assert "Pending: 2 run(s) to come: plain on B; momentum on A." in selection.table()


def test_a_run_without_validation_is_refused_in_one_line(tmp_path):
    sweep(tmp_path, everything(0.90, 0.92, 0.95))
    rows = (tmp_path / "metrics.csv").read_text().replace(",0.9\n", ",\n")
    (tmp_path / "metrics.csv").write_text(rows)
    with pytest.raises(FedcondError, match="has no validation_accuracy: run it with validation-fraction"):
        read_selection(tmp_path)
