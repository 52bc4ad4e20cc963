"""The fingerprint x conditioning study behind ``docs/fingerprints.md``.

Runs a grid of in-process Flower simulations (``strategies.simulation.simulate``) on MNIST and
writes, into ``experiments/results/fingerprints/``:

- ``runs.csv``: one row per run (final participating and held-out accuracy, time, bytes, size);
- ``rounds.csv``: every round of every run (the history.csv rows, tidy);
- ``tables.md``: per experiment, fingerprint x conditioning with FedAvg and Oracle beside them.

Run folders go to ``results/fingerprint-study/`` (not committed). A run whose folder already
finished is not run again, so the script can be interrupted and restarted:

    .venv/bin/python experiments/fingerprint_study.py --data-dir /work/shared/data [--only e3b]
    .venv/bin/python experiments/fingerprint_study.py --tables-only
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from fedcond.config import RunConfig  # noqa: E402

OUT = ROOT / "experiments" / "results" / "fingerprints"
RUNS = ROOT / "results" / "fingerprint-study"

# One budget for every run of the study: the plain-PyTorch protocol (MNIST, 10% of the data,
# 3 training clients + 1 held-out client per cluster, one local epoch of batch 64 per round).
COMMON = {
    "dataset": "mnist",
    "clients-per-cluster": 3,
    "held-out-clients": 1,
    "data-fraction": 0.1,
    "local-epochs": 1,
    "batch-size": 64,
    "num-server-rounds": 12,
    "seed": 0,
    "verbose": False,
}

EXPERIMENTS = {
    "e3b": {"scenario": "concept-permutation", "num-clusters": 2},
    "e1": {"scenario": "label-shift", "num-clusters": 5},
    "e2b-c1": {"scenario": "covariate-rotation", "num-clusters": 2, "rotations": "C1"},
    "e2b-c4": {"scenario": "covariate-rotation", "num-clusters": 4, "rotations": "C4"},
}

ALL_FINGERPRINTS = ("eigen", "class-mean", "label-cov", "class-eigen", "random-id", "cluster-id")
ALL_CONDITIONINGS = ("concat", "film", "hyper")
# E3b gets the full grid; the others a subset that answers "does the E3b ranking carry over?".
GRIDS = {
    "e3b": [(f, c) for f in ALL_FINGERPRINTS for c in ALL_CONDITIONINGS],
    "e1": [(f, c) for f in ("eigen", "class-mean") for c in ("concat", "hyper")],
    "e2b-c1": [(f, c) for f in ("eigen", "class-mean") for c in ("concat", "hyper")],
    "e2b-c4": [(f, c) for f in ("eigen", "class-mean") for c in ("concat", "hyper")],
}


@dataclass(frozen=True)
class Run:
    experiment: str
    method: str
    fingerprint: str = "-"
    conditioning: str = "-"
    seed: int = 0
    # Settings changed from COMMON, as (key, value) pairs (hashable), named in the run's folder.
    extra: tuple[tuple[str, object], ...] = ()

    @property
    def name(self) -> str:
        suffix = f"-s{self.seed}" if self.seed else ""
        suffix += "".join(f"-{key}{value}" for key, value in self.extra)
        if self.method != "conditional":
            return f"{self.experiment}-{self.method}{suffix}"
        return f"{self.experiment}-{self.fingerprint}-{self.conditioning}{suffix}"

    def config(self, data_dir: str) -> RunConfig:
        values = {**COMMON, **EXPERIMENTS[self.experiment], "method": self.method, "data-dir": data_dir}
        values["seed"] = self.seed
        values.update(dict(self.extra))
        values.update({"results-dir": str(RUNS), "run-name": self.name})
        if self.method == "conditional":
            values.update({"fingerprint": self.fingerprint, "conditioning": self.conditioning})
        return RunConfig.from_mapping(values)


# Run first what the report cannot do without, so that a cut-short study still answers the issue:
# E3b's baselines and the pairs that separate memorising from describing, then every experiment's
# baselines and main pairs, then the rest of the grid.
FIRST = {
    "e3b": [("eigen", "concat"), ("class-mean", "hyper"), ("eigen", "hyper"), ("random-id", "hyper"),
            ("cluster-id", "hyper"), ("cluster-id", "concat")],
    "e1": [("eigen", "concat"), ("class-mean", "hyper")],
    "e2b-c1": [("eigen", "concat"), ("class-mean", "hyper")],
    "e2b-c4": [("eigen", "concat"), ("class-mean", "hyper")],
}  # fmt: skip
# Last, a second seed (another split, other permutations, another initial model) of E3b's key runs.
REPEATS = [
    Run("e3b", "fedavg", seed=1),
    Run("e3b", "oracle", seed=1),
    Run("e3b", "conditional", "eigen", "hyper", seed=1),
    Run("e3b", "conditional", "class-mean", "hyper", seed=1),
    Run("e3b", "conditional", "random-id", "hyper", seed=1),
    # A wider sketch: 10 public directions per class instead of 3.
    Run("e3b", "conditional", "class-mean", "hyper", extra=(("fingerprint-dim", 100),)),
]
# Then the label-aware fingerprints under the other mechanisms, then the remaining controls.
NEXT = [("class-mean", "concat"), ("class-mean", "film"), ("label-cov", "hyper"), ("class-eigen", "hyper"),
        ("eigen", "film"), ("random-id", "concat"), ("cluster-id", "film")]  # fmt: skip


def planned(experiments: list[str]) -> list[Run]:
    """Every run of ``experiments``, most important first."""
    runs = []
    for experiment in experiments:
        runs += [Run(experiment, "fedavg"), Run(experiment, "oracle")]
        runs += [Run(experiment, "conditional", f, c) for f, c in FIRST[experiment]]
    for experiment in experiments:
        rest = [pair for pair in GRIDS[experiment] if pair not in FIRST[experiment]]
        rest.sort(key=lambda pair: NEXT.index(pair) if pair in NEXT else len(NEXT))
        runs += [Run(experiment, "conditional", f, c) for f, c in rest]
    return runs + [run for run in REPEATS if run.experiment in experiments]


def finished(run: Run) -> bool:
    folder = RUNS / run.name
    try:
        return json.loads((folder / "run.json").read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


def execute(run: Run, data_dir: str) -> None:
    from strategies.simulation import simulate

    folder = RUNS / run.name
    if folder.exists():  # an interrupted attempt: start it again under the same name
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()
    start = time.perf_counter()
    simulate(run.config(data_dir))
    print(f"{run.name}: {'finished' if finished(run) else 'FAILED'} in {time.perf_counter() - start:.0f} s", flush=True)


def read_run(run: Run) -> tuple[dict[str, object], list[dict[str, object]]] | None:
    folder = RUNS / run.name
    if not finished(run):
        return None
    info = json.loads((folder / "run.json").read_text())
    with (folder / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    last = rows[-1]
    summary = {
        "experiment": run.experiment,
        "method": run.method,
        "fingerprint": run.fingerprint,
        "conditioning": run.conditioning,
        "seed": run.seed,
        "changes": " ".join(f"{key}={value}" for key, value in run.extra),
        "rounds": len(rows),
        "accuracy": float(last["accuracy"]),
        "heldout_accuracy": float(last["heldout_accuracy"]),
        "best_accuracy": max(float(row["accuracy"]) for row in rows),
        "model_parameters": info["model_parameters"],
        "bytes_per_round": int(last["bytes_down"]) + int(last["bytes_up"]),
        "seconds": round(float(last["elapsed_seconds"]), 1),
    }
    history = [{"experiment": run.experiment, "run": run.name, **row} for row in rows]
    return summary, history


def cell(summary: dict[str, object] | None) -> str:
    if summary is None:
        return "not run"
    held = summary["heldout_accuracy"]
    held_text = "-" if isinstance(held, float) and math.isnan(held) else f"{held:.3f}"
    return f"{summary['accuracy']:.3f} / {held_text}"


def write_outputs(runs: list[Run]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    summaries, histories = {}, []
    for run in runs:
        result = read_run(run)
        if result is not None:
            summaries[run] = result[0]
            histories += result[1]
    if summaries:
        _write_csv(OUT / "runs.csv", list(summaries.values()))
    if histories:
        _write_csv(OUT / "rounds.csv", histories)
    lines = [
        "# Fingerprint x conditioning on MNIST (generated by experiments/fingerprint_study.py)",
        "",
        "Each cell: final mean local-test accuracy of the **participating** clients / of the **held-out**",
        "clients (never trained, evaluated with the shared model and their own fingerprint), after "
        f"{COMMON['num-server-rounds']} rounds. Budget per run: {json.dumps(COMMON)}.",
        "Seed 0; E3b's key runs are repeated with seed 1 at the end.",
        "",
    ]
    for experiment in dict.fromkeys(
        run.experiment for run in sorted(runs, key=lambda r: list(EXPERIMENTS).index(r.experiment))
    ):
        settings = ", ".join(f"{k}={v}" for k, v in EXPERIMENTS[experiment].items())
        lines += [f"## {experiment} ({settings})", ""]
        for baseline in ("fedavg", "oracle"):
            lines.append(f"- {baseline}: {cell(summaries.get(Run(experiment, baseline)))}")
        pairs = GRIDS[experiment]
        fingerprints = list(dict.fromkeys(f for f, _ in pairs))
        conditionings = list(dict.fromkeys(c for _, c in pairs))
        lines += ["", "| fingerprint | " + " | ".join(conditionings) + " |", "|---" * (len(conditionings) + 1) + "|"]
        for fingerprint in fingerprints:
            cells = [
                cell(summaries.get(Run(experiment, "conditional", fingerprint, c))) if (fingerprint, c) in pairs else ""
                for c in conditionings
            ]
            lines.append(f"| {fingerprint} | " + " | ".join(cells) + " |")
        lines.append("")
    repeated = [run for run in REPEATS if run in summaries]
    if repeated:
        lines += ["## A second seed (E3b)", "", "| run | seed 0 | seed 1 |", "|---|---|---|"]
        for run in (run for run in repeated if not run.extra):
            first = Run(run.experiment, run.method, run.fingerprint, run.conditioning)
            label = run.method if run.method != "conditional" else f"{run.fingerprint} / {run.conditioning}"
            lines.append(f"| {label} | {cell(summaries.get(first))} | {cell(summaries[run])} |")
        lines.append("")
        for run in (run for run in repeated if run.extra):
            changes = ", ".join(f"{key}={value}" for key, value in run.extra)
            lines.append(f"Variation, {run.fingerprint} / {run.conditioning} with {changes}: {cell(summaries[run])}")
        lines.append("")
    (OUT / "tables.md").write_text("\n".join(lines))


def _write_csv(path: Path, rows: list[dict[str, object]]) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="/work/shared/data")
    parser.add_argument("--only", nargs="*", choices=list(EXPERIMENTS), default=list(EXPERIMENTS))
    parser.add_argument("--tables-only", action="store_true", help="rebuild the tables from finished runs")
    parser.add_argument("--limit", type=int, default=0, help="run at most this many new runs")
    parser.add_argument("--repeats-only", action="store_true", help="run only the second-seed repeats")
    args = parser.parse_args()
    runs = [run for run in REPEATS if run.experiment in args.only] if args.repeats_only else planned(args.only)
    if not args.tables_only:
        todo = [run for run in runs if not finished(run)]
        for run in todo[: args.limit or None]:
            execute(run, args.data_dir)
            write_outputs(planned(list(EXPERIMENTS)))
    write_outputs(planned(list(EXPERIMENTS)))
    print((OUT / "tables.md").read_text())


if __name__ == "__main__":
    main()
