"""Every method's round-by-round history, to show that a refactoring changed no number.

    .venv/bin/python scripts/same-histories.py run OUT          # in-process digits runs of every method
    .venv/bin/python scripts/same-histories.py diff OLD NEW     # exit 1 where any history differs

``run`` runs ``fedcond compare --runner in-process`` (no Ray) of every method and variant on the
embedded digits at 2 clusters x 2 clients, 3 rounds; then with a newcomer per cluster (the methods that
serve one); then the settings whose code paths a method alone does not reach (server momentum, a
sampling schedule, evaluation by message, client-level DP, a validation split, drift), and FedBN and
local batch norm on the tests' made-up CIFAR-10 images. ``diff`` compares each run's history.csv column for column
except the wall-clock columns (``seconds``, ``elapsed_seconds``), and run.json's failures and events:
equal means equal strings, the exact floats Python wrote. Run both on the same machine (floats of
another CPU may differ in their last digits).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The wall-clock columns: the only ones two identical runs may disagree on.
TIME_COLUMNS = {"seconds", "elapsed_seconds"}
# Run settings beyond each method's defaults, each a path the methods alone do not take.
EXTRA_RUNS: dict[str, tuple[str, list[str]]] = {
    "momentum": ("fedavg,conditional,ifca", ["server-momentum=0.5"]),
    "sampled": ("fedavg,ifca,conditional", ["clients-per-round=2"]),
    "by-message": ("fedavg,conditional,ifca", ["evaluate-in-fit=false"]),
    # No noise: Flower draws client-level DP noise from numpy's unseeded global generator, so a noised run
    # differs from itself; the clipping path is what a refactoring could change.
    "client-dp": ("fedavg", ["client-dp=server-side", "client-dp-noise-multiplier=0", "client-dp-clipping-norm=0.5"]),
    "validation": ("fedavg,conditional", ["validation-fraction=0.2"]),
    "drift": ("fedavg,oracle,conditional", ["drift-round=2", "drift-fraction=0.5"]),
}


def compare(out: Path, methods: str, label: str, settings: list[str], dataset: str = "digits") -> None:
    command = [
        sys.executable, "-m", "fedcond.tools.cli", "compare", "--runner", "in-process", "--dataset", dataset,
        "--num-clusters", "2", "--clients-per-cluster", "2", "--rounds", "3", "--methods", methods,
        "--out", str(out / label), "verbose=false", *settings,
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT)


def run(out: Path) -> None:
    out = out.resolve()
    compare(out, "all,variants,competitors", "methods", [])
    # Newcomers: the methods that serve one, with a held-out client per cluster.
    compare(out, "local,fedavg,oracle,conditional,ifca,dac,gossip,ditto,cfl,pfedhn", "newcomers",
            ["held-out-clients=1", "newcomer-steps=2"])  # fmt: skip
    for label, (methods, settings) in EXTRA_RUNS.items():
        compare(out, methods, label, settings)
    # Batch norm (FedBN, local batch norm): the tests' made-up CIFAR-10 folder, nothing downloaded.
    sys.path.insert(0, str(ROOT))
    from tests.test_cifar import write_cifar10_folder

    tiny = out / "tiny-cifar10"
    if not tiny.exists():
        write_cifar10_folder(tiny / "cifar10-jpeg", per_class=(8, 4), bands=True)
    cifar = [f"data-dir={tiny}", "fingerprint-encoder=pixels"]
    compare(out, "fedbn,fedavg,conditional", "cifar", [*cifar, "held-out-clients=1"], dataset="cifar10")
    compare(out, "conditional", "local-batch", [*cifar, "feature-norm=local-batch"], dataset="cifar10")


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return [{k: v for k, v in row.items() if k not in TIME_COLUMNS} for row in csv.DictReader(handle)]


def run_record(path: Path) -> dict[str, object]:
    record = json.loads(path.read_text())
    return {key: record.get(key) for key in ("status", "failures", "events", "membership")}


def diff(old: Path, new: Path) -> int:
    old_runs = sorted(p.parent.relative_to(old) for p in old.rglob("history.csv"))
    new_runs = sorted(p.parent.relative_to(new) for p in new.rglob("history.csv"))
    if old_runs != new_runs:
        print(f"different runs: only in {old}: {sorted(set(old_runs) - set(new_runs))}; "
              f"only in {new}: {sorted(set(new_runs) - set(old_runs))}")  # fmt: skip
        return 1
    differing = []
    for run_folder in old_runs:
        if rows(old / run_folder / "history.csv") != rows(new / run_folder / "history.csv"):
            differing.append(f"{run_folder}: history.csv")
        if (old / run_folder / "run.json").exists() and run_record(old / run_folder / "run.json") != run_record(
            new / run_folder / "run.json"
        ):
            differing.append(f"{run_folder}: run.json")
    for line in differing:
        print("differs:", line)
    print(f"{len(old_runs)} runs compared, {len(differing)} differ")
    return 1 if differing else 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        run(Path(sys.argv[2]))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "diff":
        return diff(Path(sys.argv[2]), Path(sys.argv[3]))
    print("usage: same-histories.py run OUT | diff OLD NEW", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
