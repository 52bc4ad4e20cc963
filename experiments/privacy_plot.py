"""Accuracy against epsilon, from a privacy sweep: ``privacy.png`` and ``privacy.md`` in its folder.

    fedcond sweep experiments/grids/privacy-mnist-e1-k5.toml data-dir=DIR --out results/privacy
    python experiments/privacy_plot.py results/privacy

Reads every finished run under ``OUT/runs`` (its ``run.json`` and ``history.csv``): the method, the
mechanism (none, client-level DP through Flower's wrappers, DP-SGD with or without the DP
fingerprint), whether SecAgg+ was on, the final accuracy, and the run's epsilon at delta 1e-5: the
worst-off client's sample-level epsilon (history's last ``epsilon``) or the client-level epsilon
after the last round (``run.json``'s ``privacy.client_level.epsilon_by_round``). The figure puts
final accuracy against epsilon (log scale) with one line per method and mechanism (dashed: SecAgg+
on), the runs without DP as horizontal lines; the table lists every run, with each method's drop
from its no-DP accuracy, so where the privacy cost lands (Conditional against Oracle) is one column.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from fedcond.records.history import run_status
from fedcond.tools.experiment import EXPERIMENT_FILE, failed_runs, load_experiment, runs_not_started


@dataclass(frozen=True)
class Result:
    method: str
    mechanism: str
    secure: bool
    epsilon: float
    accuracy: float
    run: str


def mechanism_of(config: dict[str, object]) -> str:
    if str(config.get("client-dp", "off")) != "off":
        return f"client-level DP ({config['client-dp']})"
    if float(config.get("dp-noise-multiplier", 0.0)) > 0:  # type: ignore[arg-type]
        with_fingerprint = float(config.get("fingerprint-epsilon", 0.0)) > 0  # type: ignore[arg-type]
        return "DP-SGD + DP fingerprint" if with_fingerprint else "DP-SGD"
    return "none"


def read_results(out: Path) -> list[Result]:
    results = []
    for folder in sorted((out / "runs").iterdir()):
        if run_status(folder) != "finished":
            continue
        info = json.loads((folder / "run.json").read_text())
        with (folder / "history.csv").open() as handle:
            last = list(csv.DictReader(handle))[-1]
        config = info["config"]
        mechanism = mechanism_of(config)
        if mechanism.startswith("client-level"):
            by_round = (info.get("privacy") or {}).get("client_level", {}).get("epsilon_by_round") or [None]
            epsilon = float(by_round[-1]) if by_round[-1] is not None else math.inf
        else:
            epsilon = float(last["epsilon"]) if mechanism != "none" else math.inf
        secure = str(config.get("secure-aggregation", "none")) == "secaggplus"
        results.append(Result(config["method"], mechanism, secure, epsilon, float(last["accuracy"]), folder.name))
    return results


def unfinished_runs(out: Path) -> list[str]:
    """One line per grid point of the sweep that did not finish, in run-name order: the runs that
    stopped, with their rounds and reasons (client-level DP at epsilon 1 stops when clients
    diverge: a result too), and those never started."""
    experiment = load_experiment(out)
    endings = {name: ": not run" for name in runs_not_started(experiment, out)}
    for name, status in failed_runs(experiment, out):
        rounds = json.loads((out / "runs" / name / "run.json").read_text()).get("rounds_completed")
        after = f" after {rounds} round{'' if rounds == 1 else 's'}" if rounds is not None else ""
        endings[name] = f"{after}: {status}"
    return [f"- `{name}`{ending}" for name, ending in sorted(endings.items())]


def table(results: list[Result]) -> str:
    baseline = {(r.method, r.secure): r.accuracy for r in results if r.mechanism == "none"}
    lines = [
        "| method | mechanism | SecAgg+ | epsilon | final accuracy | change from no DP | run |",
        "|---|---|---|---|---|---|---|",
    ]
    order = sorted(results, key=lambda r: (r.method, r.secure, r.mechanism != "none", r.mechanism, -r.epsilon))
    for r in order:
        base = baseline.get((r.method, r.secure), baseline.get((r.method, False)))
        change = f"{r.accuracy - base:+.3f}" if base is not None and r.mechanism != "none" else ""
        epsilon = "none" if math.isinf(r.epsilon) else f"{r.epsilon:.3g}"
        lines.append(
            f"| {r.method} | {r.mechanism} | {'on' if r.secure else 'off'} | {epsilon} | {r.accuracy:.4f} | {change} "
            f"| `{r.run}` |"
        )
    return "\n".join(lines) + "\n"


def figure(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(11, 5))
    colours = {method: f"C{index}" for index, method in enumerate(sorted({r.method for r in results}))}
    markers = {"client-level DP": "s", "DP-SGD + DP fingerprint": "o", "DP-SGD": "^"}
    lines: dict[tuple[str, str, bool], list[Result]] = defaultdict(list)
    for r in results:
        if r.mechanism == "none":
            style = "--" if r.secure else "-"
            label = f"{r.method}, no DP{', SecAgg+' if r.secure else ''}"
            axis.axhline(r.accuracy, color=colours[r.method], linestyle=style, linewidth=0.8, alpha=0.6, label=label)
        elif math.isfinite(r.epsilon):
            lines[(r.method, r.mechanism, r.secure)].append(r)
    for (method, mechanism, secure), points in sorted(lines.items()):
        points.sort(key=lambda r: r.epsilon)
        marker = next((m for name, m in markers.items() if mechanism.startswith(name)), "x")
        axis.plot(
            [r.epsilon for r in points], [r.accuracy for r in points], marker=marker, color=colours[method],
            linestyle="--" if secure else "-", label=f"{method}, {mechanism}{', SecAgg+' if secure else ''}",
        )  # fmt: skip
    axis.set_xscale("log")
    # Ticks at the epsilons that ran (1, 3, 8), in plain numbers rather than powers of ten.
    ticks = sorted({float(f"{r.epsilon:.2g}") for r in results if math.isfinite(r.epsilon)})  # 7.99 and 8: one
    axis.set_xticks(ticks, [f"{tick:g}" for tick in ticks])
    axis.minorticks_off()
    axis.set_xlabel("epsilon (delta 1e-5; client level or the worst-off client's sample level)")
    axis.set_ylabel("final accuracy")
    axis.set_title("Accuracy against epsilon (horizontal lines: no DP)")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines, not on them
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the sweep's --out folder")
    args = parser.parse_args()
    if not (args.out / "runs").is_dir() or not (args.out / EXPERIMENT_FILE).is_file():
        sys.exit(f"{args.out} has no runs/ folder or {EXPERIMENT_FILE}; give a fedcond sweep --out folder")
    results = read_results(args.out)
    if not results:
        sys.exit(f"no finished run under {args.out / 'runs'}")
    unfinished = unfinished_runs(args.out)
    text = table(results) + ("\nRuns that did not finish:\n\n" + "\n".join(unfinished) + "\n" if unfinished else "")
    (args.out / "privacy.md").write_text("# Accuracy against epsilon\n\n![privacy](privacy.png)\n\n" + text)
    figure(results, args.out / "privacy.png")
    print(text, end="")
    print(f"written: {args.out / 'privacy.md'}, {args.out / 'privacy.png'}")


if __name__ == "__main__":
    main()
