"""Paired differences against a reference method, per grid point, over the seeds both ran.

    python experiments/paired_intervals.py RESULTS_DIR [RESULTS_DIR ...] --reference oracle [--column accuracy]

For every method and grid point (the folder's axes other than method and seed), the final-round value
of ``--column`` minus the reference's, seed by seed, then the mean difference, its 95% Student-t
half-width over the paired seeds and the verdict they allow (``above``, ``below``, or ``not
established at n seeds``: ``fedcond.tools.report.paired_verdict``; docs/instability.md quotes these).
A method missing a seed the reference has is paired on the seeds both have, and the seed count is
printed.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcond.tools.experiment import column_name, load_experiment
from fedcond.tools.report import confidence_half_width, paired_verdict
from tools.claims import Side, final_by_seed


def final_values(folder: Path, column: str) -> dict[tuple[str, str], dict[str, float]]:
    """(grid point, method) -> seed -> the final round's ``column`` (NaN rows skipped)."""
    with (folder / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    point_axes = [column_name(axis) for axis in load_experiment(folder).point_axes]
    points = {tuple(row[axis] for axis in point_axes) for row in rows}
    finals = {}
    for point in points:
        for method in {row["method"] for row in rows}:
            values = final_by_seed(rows, Side(method, dict(zip(point_axes, point, strict=True))), column)
            if values:
                finals[(",".join(point), method)] = values
    return finals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--reference", default="oracle")
    parser.add_argument("--column", default="accuracy")
    arguments = parser.parse_args()
    for folder in arguments.folders:
        finals = final_values(folder, arguments.column)
        print(f"## {folder}: final {arguments.column}, paired against {arguments.reference} (points, 95% t)")
        print("| point | method | seeds | mean | mean - reference | 95% half-width | verdict |")
        print("|---|---|---|---|---|---|---|")
        for (point, method), seeds in sorted(finals.items()):
            reference = finals.get((point, arguments.reference), {})
            paired = sorted(set(seeds) & set(reference))
            differences = [100 * (seeds[seed] - reference[seed]) for seed in paired]
            mean = sum(seeds.values()) / len(seeds)
            if method == arguments.reference or not differences:
                print(f"| {point} | {method} | {len(seeds)} | {mean:.3f} | | | |")
                continue
            half = confidence_half_width(differences) if len(differences) > 1 else math.nan
            average = sum(differences) / len(differences)
            verdict = paired_verdict(differences)
            print(f"| {point} | {method} | {len(paired)} | {mean:.3f} | {average:+.2f} | {half:.2f} | {verdict} |")
        print()


if __name__ == "__main__":
    main()
