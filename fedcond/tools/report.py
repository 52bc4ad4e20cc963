"""Reports from a tidy ``metrics.csv``: a ranked summary, paper-layout tables and their figures,
each with the paper's published number beside ours, and the reproduction report of many folders.

Everything here reads only the tidy rows (and the paper's ``experiments/paper/results.csv``), so a
table or a plot can be redrawn from any results file (``fedcond report OUT``) without rerunning
anything.
"""

from __future__ import annotations

import csv
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcond.errors import FedcondError
from fedcond.records.history import dataset_metric, row_in_memory
from fedcond.records.metrics import LOWER_IS_BETTER
from fedcond.tools.experiment import (
    CLASS_PREFIX,
    CODE_COLUMN,
    METRIC_COLUMNS,
    METRICS_FILE,
    OPTIONAL_METRIC_COLUMNS,
    SETTING_COLUMNS,
    VARIANT_COLUMNS,
    VARIANT_DEFAULTS,
    TableSpec,
    as_float,
    class_column,
    column_name,
    format_duration,
    load_experiment,
)
from fedcond.tools.paper import PaperMatch, character_value, lookup, tables_in_order

Row = dict[str, str]
# Legend lines naming why a setting has no paper counterpart, at most (a sweep of our variants has many).
MAX_REASONS = 6
METRIC_NAMES = frozenset((*METRIC_COLUMNS, *OPTIONAL_METRIC_COLUMNS))
# The paper's names for the axes its tables sweep.
SHORT_NAMES = {"num-clusters": "K", "clients-per-cluster": "clients/cluster"}
DRIFT_FIGURE = "drift.png"
#: What a paper-layout table's cells can show: the training clients' and the held-out clients' columns.
#: Validation (``validation-fraction``) is what settings are chosen on; test is what is reported.
SCORES = {
    "test": ("accuracy", "heldout_accuracy"),
    "validation": ("validation_accuracy", "heldout_validation_accuracy"),
}


def read_metrics(path: Path) -> list[Row]:
    """The tidy rows, a regression task's score columns (rmse) under their in-memory names."""
    with path.open(newline="") as handle:
        return [_score_named(row) for row in csv.DictReader(handle)]


def _score_named(row: Row) -> Row:
    # A tidy file mixing tasks has both tasks' columns; a regression row's rmse columns come after
    # the (empty) accuracy ones and so are the values its in-memory names keep.
    return row_in_memory(row, dataset_metric(row.get("dataset", "")))


def confidence_half_width(values: Sequence[float], level: float = 0.95) -> float:
    """Half-width of the Student-t confidence interval of the mean of the finite ``values``; NaN for
    fewer than two."""
    values = [value for value in values if math.isfinite(value)]
    if len(values) < 2:
        return math.nan
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values)))


def paired_verdict(differences: Sequence[float]) -> str:
    """What paired differences (method minus reference, one per seed both ran, same splits) allow:
    ``above`` or ``below`` where the 95% Student-t interval of their mean excludes 0, else ``not
    established at n seeds`` (one seed establishes nothing)."""
    finite = [value for value in differences if math.isfinite(value)]
    half = confidence_half_width(finite)
    mean = float(np.mean(finite)) if finite else math.nan
    if not math.isfinite(half) or abs(mean) <= half:
        return f"not established at {len(finite)} seed{'s' * (len(finite) != 1)}"
    return "above" if mean > 0 else "below"


@dataclass(frozen=True)
class MethodSummary:
    """One method over its seeds: final accuracy, best round, time and traffic."""

    method: str
    seeds: int
    final_mean: float
    final_half_width: float
    best_round: int
    best_accuracy: float
    rounds: int
    wall_seconds: float
    megabytes_down: float
    megabytes_up: float
    final_ari: float
    final_heldout: float
    #: The worst client's final accuracy (history.csv's ``worst_accuracy``), mean over seeds; NaN for
    #: runs recorded before the column existed. Likewise the worst held-out client's.
    final_worst: float = math.nan
    final_heldout_worst: float = math.nan
    #: The held-out clients' final accuracy after newcomer-steps local steps (NaN: not measured).
    final_heldout_adapted: float = math.nan
    #: The drifting clients' final accuracy (NaN: no drift).
    final_drifted: float = math.nan
    #: The final validation accuracy of the training clients and of the held-out ones
    #: (``validation-fraction``; NaN without): what settings are chosen on, never the test score.
    final_validation: float = math.nan
    final_heldout_validation: float = math.nan


#: A row's name in a report where a method axis names its runs (``labelled_runs``); never in metrics.csv.
RUN_LABEL = "run-label"


def labelled_runs(rows: Sequence[Row], columns: Sequence[str]) -> list[Row]:
    """``rows`` with each run named by its ``columns`` (the method axes' labels: "Ens", "Lin") where
    a grid has such axes; the rows' own method stays, for the paper's lookup."""
    if not columns:
        return list(rows)
    return [{**row, RUN_LABEL: " ".join(str(row[column]) for column in columns)} for row in rows]


def _runs(rows: Iterable[Row]) -> dict[tuple[str, str], list[Row]]:
    """Rows of each (method, or the run's label where a method axis names it; seed), in round order."""
    runs: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for row in rows:
        runs[(str(row.get(RUN_LABEL) or row["method"]), row["seed"])].append(row)
    for history in runs.values():
        history.sort(key=lambda row: int(row["round"]))
    return runs


def _histories_by_method(rows: Iterable[Row]) -> dict[str, list[list[Row]]]:
    """Each method's runs (one per seed), each in round order."""
    by_method: dict[str, list[list[Row]]] = defaultdict(list)
    for (method, _), history in _runs(rows).items():
        by_method[method].append(history)
    return by_method


class SeedMean(float):
    """A mean over the runs (seeds) that measured it: ``n`` of the ``of`` runs asked; shown with that
    count wherever it is not all of them (``format_accuracy``), never as a mean of them all."""

    n: int
    of: int

    def __new__(cls, value: float, n: int, of: int) -> SeedMean:
        mean = super().__new__(cls, value)
        mean.n, mean.of = n, of
        return mean


def _mean(values: Iterable[float]) -> SeedMean:
    values = list(values)
    finite = [value for value in values if math.isfinite(value)]
    return SeedMean(float(np.mean(finite)) if finite else math.nan, len(finite), len(values))


def rows_metric(rows: Iterable[Row]) -> str:
    """What the rows' score is: ``rmse`` where every row is of a regression task, else accuracy."""
    metrics = {dataset_metric(row.get("dataset", "")) for row in rows}
    return metrics.pop() if len(metrics) == 1 else "accuracy"


def fully_scored(history: Sequence[Row]) -> list[bool]:
    """Per round of one run, whether every training client that answered scored it: its
    ``clients_evaluated`` is the run's most (the last round's, which every client scores); a history
    written before the column existed counts every round."""
    counts = [as_float(row.get("clients_evaluated", "")) for row in history]
    if not counts or not all(math.isfinite(count) for count in counts):
        return [True] * len(history)
    return [count == max(counts) for count in counts]


def summarise(rows: Sequence[Row]) -> list[MethodSummary]:
    """Per method (rows of one scenario), ranked by mean final score, best first (the highest
    accuracy; the lowest RMSE)."""
    lower = rows_metric(rows) in LOWER_IS_BETTER
    by_method = _histories_by_method(rows)
    summaries = []
    for method, histories in by_method.items():
        finals = [as_float(history[-1]["accuracy"]) for history in histories]
        rounds = min(len(history) for history in histories)
        # The best round of the mean curve: what a user stopping at the right moment would get; only
        # among rounds every training client scored (a sample's score is not the federation's).
        scored = [fully_scored(history) for history in histories]
        curve = [
            _mean(as_float(history[r]["accuracy"]) for history in histories)
            if all(full[r] for full in scored)
            else math.nan
            for r in range(rounds)
        ]
        best = int(np.nanargmin(curve) if lower else np.nanargmax(curve)) if rounds else 0
        summaries.append(
            MethodSummary(
                method=method,
                seeds=len(histories),
                final_mean=_mean(finals),
                final_half_width=confidence_half_width(finals),
                best_round=best + 1,
                best_accuracy=curve[best] if rounds else math.nan,
                rounds=rounds,
                wall_seconds=_mean(as_float(history[-1]["elapsed_seconds"]) for history in histories),
                megabytes_down=_mean(sum(as_float(r["bytes_down"]) for r in history) / 1e6 for history in histories),
                megabytes_up=_mean(sum(as_float(r["bytes_up"]) for r in history) / 1e6 for history in histories),
                final_ari=_mean(as_float(history[-1].get("ari", "")) for history in histories),
                final_heldout=_mean(as_float(history[-1].get("heldout_accuracy", "")) for history in histories),
                final_worst=_mean(as_float(history[-1].get("worst_accuracy", "")) for history in histories),
                final_heldout_worst=_mean(
                    as_float(history[-1].get("heldout_worst_accuracy", "")) for history in histories
                ),
                final_heldout_adapted=_mean(
                    as_float(history[-1].get("heldout_adapted_accuracy", "")) for history in histories
                ),
                final_drifted=_mean(as_float(history[-1].get("drifted_accuracy", "")) for history in histories),
                final_validation=_mean(as_float(history[-1].get("validation_accuracy", "")) for history in histories),
                final_heldout_validation=_mean(
                    as_float(history[-1].get("heldout_validation_accuracy", "")) for history in histories
                ),
            )
        )
    sign = 1 if lower else -1
    # Runs that hold out validation data are ranked by it: a ranking is a choice, and settings are
    # chosen on validation, never on the test score the table also reports.
    by_validation = ranked_by_validation(summaries)

    def key(summary: MethodSummary) -> float:
        score = summary.final_validation if by_validation else summary.final_mean
        return sign * score if math.isfinite(score) else math.inf

    return sorted(summaries, key=key)


def ranked_by_validation(summaries: Sequence[MethodSummary]) -> bool:
    """Whether every method measured validation accuracy (``validation-fraction``), so ranks read it."""
    return bool(summaries) and all(math.isfinite(s.final_validation) for s in summaries)


def format_accuracy(mean: float, half_width: float = math.nan) -> str:
    """``0.912 ± 0.013``; a mean some runs did not measure says over how many it is
    (``0.115 (2 of 3 seeds)``)."""
    if not math.isfinite(mean):
        return "n/a"
    text = f"{mean:.3f} ± {half_width:.3f}" if math.isfinite(half_width) else f"{mean:.3f}"
    if isinstance(mean, SeedMean) and mean.n < mean.of:
        text += f" ({mean.n} of {mean.of} seeds)"
    return text


def format_delta(ours: float, paper: float, metric: str = "accuracy") -> str:
    """Ours minus the paper's, in accuracy points (``-1.2``); an RMSE's difference as it is (``+0.031``)."""
    if not math.isfinite(ours):
        return "n/a"
    return f"{ours - paper:+.3f}" if metric in LOWER_IS_BETTER else f"{(ours - paper) * 100:+.1f}"


def delta_unit(metric: str) -> str:
    return "in RMSE (lower is better)" if metric in LOWER_IS_BETTER else "in points"


def paper_match(final_rows: Iterable[Row]) -> PaperMatch:
    """The paper's counterpart of a number pooled from several runs (one final row each): the one
    they all share, or none."""
    try:
        matches = {lookup(row) for row in final_rows}
    except FedcondError as error:  # the paper's CSV is missing: the report still stands without it
        return PaperMatch(None, reason=str(error))
    if len(matches) == 1:
        return matches.pop()
    reasons = sorted({match.reason for match in matches if not match.found})
    return PaperMatch(None, reason="; ".join(reasons) or "its runs have different paper counterparts")


def paper_matches(rows: Sequence[Row]) -> dict[str, PaperMatch]:
    """The paper's counterpart of every method of one scenario point."""
    finals: dict[str, list[Row]] = defaultdict(list)
    for (method, _), history in _runs(rows).items():
        finals[method].append(history[-1])
    return {method: paper_match(final_rows) for method, final_rows in finals.items()}


def _paper_cells(mean: float, match: PaperMatch | None, metric: str = "accuracy") -> list[str]:
    if match is None or not match.found:
        return ["—", "—"]
    return [f"{match.value:.3f}", format_delta(mean, match.value, metric)]


def _with_paper(matches: Mapping[str, PaperMatch] | None) -> bool:
    return bool(matches) and any(match.found for match in matches.values())


def summary_table(
    summaries: Sequence[MethodSummary], paper: Mapping[str, PaperMatch] | None = None, metric: str = "accuracy"
) -> str:
    """Markdown: one ranked row per method, with the paper's number and our difference when it has one."""
    with_ari = any(math.isfinite(s.final_ari) for s in summaries)
    with_heldout = any(math.isfinite(s.final_heldout) for s in summaries)
    with_worst = any(math.isfinite(s.final_worst) for s in summaries)
    with_heldout_worst = any(math.isfinite(s.final_heldout_worst) for s in summaries)
    with_adapted = any(math.isfinite(s.final_heldout_adapted) for s in summaries)
    with_drift = any(math.isfinite(s.final_drifted) for s in summaries)
    with_validation = any(math.isfinite(s.final_validation) for s in summaries)
    with_heldout_validation = any(math.isfinite(s.final_heldout_validation) for s in summaries)
    with_paper = _with_paper(paper)
    rank = "rank (by validation)" if ranked_by_validation(summaries) else "rank"
    header = [rank, "method", "seeds", f"final {metric}"] + ["paper", "Δ vs paper"] * with_paper
    header += ["worst client"] * with_worst + ["best (round)", "wall s", "MB down", "MB up"]
    header += ["ARI"] * with_ari + [f"held-out {metric}"] * with_heldout + ["worst held-out"] * with_heldout_worst
    header += ["held-out after newcomer-steps"] * with_adapted + ["drifting clients"] * with_drift
    header += ["validation"] * with_validation + ["held-out validation"] * with_heldout_validation
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rank, s in enumerate(summaries, start=1):
        cells = [
            str(rank),
            s.method,
            str(s.seeds),
            format_accuracy(s.final_mean, s.final_half_width),
            *(_paper_cells(s.final_mean, (paper or {}).get(s.method), metric) if with_paper else []),
            *[format_accuracy(s.final_worst)] * with_worst,
            f"{s.best_accuracy:.3f} (r{s.best_round})",
            f"{s.wall_seconds:.0f}",
            f"{s.megabytes_down:.1f}",
            f"{s.megabytes_up:.1f}",
        ]
        cells += [format_accuracy(s.final_ari)] * with_ari + [format_accuracy(s.final_heldout)] * with_heldout
        cells += [format_accuracy(s.final_heldout_worst)] * with_heldout_worst
        cells += [format_accuracy(s.final_heldout_adapted)] * with_adapted
        cells += [format_accuracy(s.final_drifted)] * with_drift
        cells += [format_accuracy(s.final_validation)] * with_validation
        cells += [format_accuracy(s.final_heldout_validation)] * with_heldout_validation
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _budget(rows: Sequence[Row]) -> tuple[list[str], int]:
    """The data fractions and the most rounds of some runs."""
    fractions = sorted({row.get("data_fraction", "") for row in rows} - {""}, key=float)
    return fractions, max((int(row["round"]) for row in rows), default=0)


def paper_legend(rows: Sequence[Row], matches: Mapping[str, PaperMatch]) -> list[str]:
    """Lines under a table with a paper column: what the column is, the assumptions behind each
    match, the other values the paper prints, the budget of our runs, and what has no counterpart."""
    found = {label: match for label, match in matches.items() if match.found}
    lines = []
    if found:
        tables = tables_in_order({table for match in found.values() for table in match.tables})
        metric = rows_metric(rows)
        lines.append(
            f"paper: the paper's {metric} for the same experiment, dataset, K, clients per cluster and method "
            f"({'Table' if len(tables) == 1 else 'Tables'} {', '.join(tables)}; experiments/paper/results.md); "
            f"Δ: ours minus paper, {delta_unit(metric)}."
        )
        lines += sorted({note for match in found.values() for note in match.notes})
        others = [
            f"{label} {value:.3f} (Table {', '.join(where)})"
            for label, match in found.items()
            for value, where in match.others
        ]
        if others:
            lines.append("The paper prints the same setting elsewhere with other values: " + "; ".join(others) + ".")
        if any(label.startswith("pooled-global") for label in found):
            lines.append(
                "pooled-global is set beside the paper's FedAvg column, one model on all data; the paper does not "
                "say how many rounds its FedAvg ran, so neither fedavg nor pooled-global is its exact counterpart."
            )
        fractions, rounds = _budget(rows)
        if any(float(fraction) < 1 for fraction in fractions):
            lines.append(
                f"The paper's numbers are full-data (20 epochs of pooled training); these runs used data-fraction "
                f"{', '.join(fractions)} and {rounds} rounds, so Δ measures the smaller budget as well as the method."
            )
    missing: dict[str, list[str]] = defaultdict(list)
    for label, match in matches.items():
        if not match.found:
            missing[match.reason].append(label)
    # With a paper column, its "—" cells are what this explains; without one, the whole table is.
    prefix = "—: no paper counterpart" if found else "No paper counterpart"
    for reason, labels in list(missing.items())[:MAX_REASONS]:
        lines.append(f"{prefix} for {', '.join(labels)}: {reason}.")
    if len(missing) > MAX_REASONS:
        lines.append(f"— and {len(missing) - MAX_REASONS} more settings without a paper counterpart.")
    return lines + provenance_lines(rows)


def provenance_lines(rows: Sequence[Row]) -> list[str]:
    """Lines under a table whose runs came from more than one version of the code, or from code with
    uncommitted changes (metrics.csv's ``code``, from each run.json); none where no run knows its code."""
    codes = {run: history[-1].get(CODE_COLUMN, "") for run, history in _runs(rows).items()}
    if not any(codes.values()):
        return []
    lines = []
    by_code: dict[str, list[str]] = defaultdict(list)
    for (method, seed), code in codes.items():
        by_code[code or "unknown (recorded before runs knew their commit)"].append(f"{method} seed {seed}")
    if len(by_code) > 1:
        lines.append(
            f"These runs come from {len(by_code)} versions of the code (run.json's code): "
            + "; ".join(f"{code}: {', '.join(runs)}" for code, runs in sorted(by_code.items()))
            + "."
        )
    dirty = [run for code, runs in sorted(by_code.items()) if "+changes" in code for run in runs]
    if dirty:
        lines.append(f"Made from code with uncommitted changes: {', '.join(dirty)}.")
    return lines


def legend_markdown(lines: Sequence[str]) -> list[str]:
    """Legend lines as a Markdown list after a blank line (nothing when there are none)."""
    return ["", *(f"- {line}" for line in lines)] if lines else []


def ranked_section(rows: Sequence[Row]) -> list[str]:
    """The ranked table of one scenario point with the paper beside it, then its legend."""
    matches = paper_matches(rows)
    table = summary_table(summarise(rows), matches, rows_metric(rows))
    return [table, *legend_markdown(paper_legend(rows, matches))]


def scenario_line(rows: Sequence[Row]) -> str:
    first = rows[0]
    return (
        f"{first['dataset']}, {first['scenario']}, K={first['num_clusters']} x {first['clients_per_cluster']} "
        f"clients, data-fraction {first['data_fraction']}"
        + (f", rotations {first['rotations']}" if first.get("rotations") else "")
    )


def summary_markdown(
    rows: Sequence[Row],
    title: str,
    failures: Sequence[tuple[str, str]] = (),
    recoveries: Sequence[DriftRecovery] = (),
    drift_round: int = 0,
) -> str:
    """``summary.md`` of a comparison: the ranked table, what it was run on, the drifting clients'
    ``recoveries`` around ``drift_round`` (``drift_recoveries``), and any failed runs."""
    parts = [f"# {title}", ""]
    if rows:
        seeds = sorted({row["seed"] for row in rows}, key=int)
        metric = rows_metric(rows)
        parts += [
            f"{scenario_line(rows)}; seeds {', '.join(seeds)}. Final {metric} is the mean over seeds of the",
            f"last round's sample-weighted {metric} of every client on its own test data, ± the 95% Student-t",
            "confidence half-width when there are several seeds. Wall time is per run; traffic sums all rounds.",
            "",
            *ranked_section(rows),
        ]
        if recoveries:
            parts += [
                "",
                "## Drifting clients",
                "",
                *drift_table(recoveries, drift_round),
                "",
                f"![drift]({DRIFT_FIGURE})",
            ]
    else:
        parts.append("No run has finished yet.")
    if failures:
        parts += ["", "Runs that did not finish:", ""] + [f"- `{name}`: {status}" for name, status in failures]
    return "\n".join(parts) + "\n"


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def convergence_plot(rows: Sequence[Row], path: Path, title: str) -> Path:
    """Accuracy vs round, one line per method (mean over seeds), shaded min-max band across seeds;
    dashed, the worst client's accuracy (mean over seeds) where the histories have it; dotted, the
    drifting clients' (``drifted_accuracy``)."""
    plt = _figure()
    figure, axes = plt.subplots(figsize=(8, 5))
    drawn_worst = drawn_drift = False
    by_method = _histories_by_method(rows)
    for method in [s.method for s in summarise(rows)]:
        histories = by_method[method]
        rounds = min(len(history) for history in histories)
        matrix = np.array([[as_float(history[r]["accuracy"]) for r in range(rounds)] for history in histories])
        x = np.arange(1, rounds + 1)
        (line,) = axes.plot(x, matrix.mean(axis=0), marker="o", markersize=3, label=method)
        if len(histories) > 1:
            axes.fill_between(x, matrix.min(axis=0), matrix.max(axis=0), color=line.get_color(), alpha=0.2)
        worst = np.array([[as_float(h[r].get("worst_accuracy", "")) for r in range(rounds)] for h in histories])
        if np.isfinite(worst).any():  # the worst client, dashed in the method's colour (absent in older runs)
            drawn_worst = True
            mean_worst = [_mean(worst[:, r]) for r in range(rounds)]
            axes.plot(x, mean_worst, linestyle="--", linewidth=1, color=line.get_color())
        drifted = np.array([[as_float(h[r].get("drifted_accuracy", "")) for r in range(rounds)] for h in histories])
        if np.isfinite(drifted).any():  # the drifting clients (fedcond.data.drift), dotted
            drawn_drift = True
            axes.plot(x, [_mean(drifted[:, r]) for r in range(rounds)], linestyle=":", linewidth=1.5,
                      color=line.get_color())  # fmt: skip
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("federated round")
    notes = [*(["dashed: worst client"] * drawn_worst), *(["dotted: drifting clients"] * drawn_drift)]
    axes.set_ylabel(f"mean client test {rows_metric(rows)}" + (f" ({'; '.join(notes)})" if notes else ""))
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.set_title(title)
    axes.legend(title="method (best final first)", loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


#: The drifting clients have recovered once back within this much of their accuracy the round before
#: the drift (5 points: about the round-to-round noise of a quarter-data MNIST run's mean).
RECOVERY_MARGIN = 0.05


@dataclass(frozen=True)
class DriftRecovery:
    """The drifting clients' accuracy (mean over seeds) around the drift round D of one method."""

    method: str
    before: float  # round D - 1: their old data, the last round before they move
    at_drift: float  # round D: their new data, scored by what the method serves them then
    final: float
    #: Rounds from D until they are back within RECOVERY_MARGIN of ``before`` (0: never lost it);
    #: None: not back by the last round.
    rounds_to_recover: int | None


def drifted_curve(histories: Sequence[Sequence[Row]]) -> list[float]:
    """The drifting clients' accuracy each round, mean over seeds (NaN where not measured)."""
    rounds = min(len(history) for history in histories)
    return [_mean(as_float(history[r].get("drifted_accuracy", "")) for history in histories) for r in range(rounds)]


def rounds_to_recover(curve: Sequence[float], drift_round: int, margin: float = RECOVERY_MARGIN) -> int | None:
    """Rounds after ``drift_round`` until ``curve`` (one value per round from round 1) is back within
    ``margin`` of its value the round before; None when it never is."""
    before = curve[drift_round - 2]
    for index in range(drift_round - 1, len(curve)):
        if curve[index] >= before - margin:
            return index - (drift_round - 1)
    return None


def drift_recoveries(rows: Sequence[Row], drift_round: int) -> list[DriftRecovery]:
    """Per method (best final accuracy first), how its drifting clients fared around ``drift_round``;
    empty without drifting clients, or when the drift is at round 1 (no round before it)."""
    if drift_round < 2:
        return []
    by_method = _histories_by_method(rows)
    recoveries = []
    for method in [s.method for s in summarise(rows)]:
        curve = drifted_curve(by_method[method])
        if len(curve) < drift_round or not all(math.isfinite(v) for v in curve[drift_round - 2 :]):
            continue
        recovery = rounds_to_recover(curve, drift_round)
        recoveries.append(DriftRecovery(method, curve[drift_round - 2], curve[drift_round - 1], curve[-1], recovery))
    return recoveries


def drift_table(recoveries: Sequence[DriftRecovery], drift_round: int) -> list[str]:
    """Markdown lines: the drifting clients' accuracy before, at and after the drift, and the rounds
    each method needs to serve them again."""
    header = ["method", f"before (round {drift_round - 1})", f"at the drift (round {drift_round})", "final"]
    lines = ["| " + " | ".join([*header, "rounds to recover"]) + " |", "|---|---|---|---|---|"]
    for r in recoveries:
        recovered = "not by the last round" if r.rounds_to_recover is None else str(r.rounds_to_recover)
        lines.append(f"| {r.method} | {r.before:.3f} | {r.at_drift:.3f} | {r.final:.3f} | {recovered} |")
    return [
        *lines,
        "",
        f"- Rounds to recover: rounds after round {drift_round} until the drifting clients are back within "
        f"{RECOVERY_MARGIN * 100:.0f} points of their accuracy in round {drift_round - 1} (0: they never lost more).",
    ]


def drift_plot(rows: Sequence[Row], path: Path, title: str, drift_round: int) -> Path:
    """The drifting clients' accuracy against the round, one line per method, the drift marked."""
    plt = _figure()
    figure, axes = plt.subplots(figsize=(8, 5))
    by_method = _histories_by_method(rows)
    for method in [s.method for s in summarise(rows)]:
        curve = drifted_curve(by_method[method])
        axes.plot(np.arange(1, len(curve) + 1), curve, marker="o", markersize=3, label=method)
    axes.axvline(drift_round - 0.5, color="grey", linestyle="--", linewidth=1)
    axes.annotate(f"clients move: round {drift_round}", (drift_round - 0.4, 0.03), color="grey", fontsize="small")
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("federated round")
    axes.set_ylabel("drifting clients' test accuracy")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.set_title(title, fontsize="medium", wrap=True)
    axes.legend(title="method (best final first)", loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _final_rows(rows: Sequence[Row], keys: Sequence[str]) -> dict[tuple[str, ...], list[Row]]:
    """Final-round row of every run, grouped by the values of ``keys`` (pooling seeds and any axis
    that ``keys`` leave out)."""
    finals: dict[tuple[str, ...], list[Row]] = defaultdict(list)
    last: dict[tuple[str, ...], Row] = {}
    for row in rows:
        # A run is identified by every non-metric column, so axes a table does not show stay apart.
        # (A final row's per-class cells are metrics too: the rounds before it leave them empty.)
        run = tuple(value for column, value in row.items()
                    if column not in METRIC_NAMES and not column.startswith(CLASS_PREFIX))  # fmt: skip
        if run not in last or int(row["round"]) > int(last[run]["round"]):
            last[run] = row
    for row in last.values():
        finals[tuple(row[key] for key in keys)].append(row)
    return finals


def _ordered(values: Iterable[str]) -> list[str]:
    """Axis values in natural order: numbers numerically, the rest as first seen."""
    unique = list(dict.fromkeys(values))
    try:
        return sorted(unique, key=lambda v: tuple(map(float, v)) if isinstance(v, tuple) else float(v))
    except ValueError:
        return unique


@dataclass(frozen=True)
class TableData:
    """What a paper-layout table shows: row values, groups, column-axis values and final accuracies."""

    axis_names: list[str]
    rows: list[str]
    groups: list[str]
    columns: list[tuple[str, ...]]
    finals: dict[tuple[str, ...], list[Row]]
    grouped: bool
    #: What a cell shows: a key of ``SCORES`` (the test score, or the validation share's).
    score: str = "test"

    @classmethod
    def of(cls, rows: Sequence[Row], spec: TableSpec, score: str = "test") -> TableData:
        """Collect from tidy rows; the spec's axes are run-config keys, the tidy file's are snake_case."""
        columns = [column_name(axis) for axis in spec.columns]
        groups = column_name(spec.groups) if spec.groups else None
        keys = [column_name(spec.rows), *([groups] if groups else []), *columns]
        return cls(
            axis_names=[SHORT_NAMES.get(axis, axis) for axis in spec.columns],
            rows=_ordered(row[keys[0]] for row in rows),
            groups=_ordered(row[groups] for row in rows) if groups else [""],
            columns=_ordered(tuple(row[c] for c in columns) for row in rows) if columns else [()],
            finals=_final_rows(rows, keys),
            grouped=groups is not None,
            score=score,
        )

    def cell_rows(self, row: str, group: str, values: tuple[str, ...]) -> list[Row]:
        """Final rows (one per run) of one cell; empty where nothing ran."""
        return self.finals.get((row, *([group] if self.grouped else []), *values), [])

    def cell(self, row: str, group: str, values: tuple[str, ...]) -> list[float]:
        """Final scores (one per run, so one per seed) of one cell; empty where nothing ran."""
        column = SCORES[self.score][0]
        return [as_float(final.get(column, "")) for final in self.cell_rows(row, group, values)]

    def heldout_cell(self, row: str, group: str, values: tuple[str, ...]) -> list[float]:
        """Final scores of the held-out clients (never trained) of one cell; empty without them."""
        column = SCORES[self.score][1]
        finals = [as_float(final.get(column, "")) for final in self.cell_rows(row, group, values)]
        # A run without held-out clients stays in the list as NaN: the cell's mean says it is over fewer.
        return finals if any(math.isfinite(value) for value in finals) else []

    @property
    def has_heldout(self) -> bool:
        finals = (final for cell in self.finals.values() for final in cell)
        return any(math.isfinite(as_float(final.get(SCORES[self.score][1], ""))) for final in finals)

    def header(self, group: str, values: tuple[str, ...]) -> str:
        label = ", ".join(f"{name}={value}" for name, value in zip(self.axis_names, values, strict=True))
        return " ".join(part for part in (group, label) if part) or "final accuracy"


def paper_table(rows: Sequence[Row], spec: TableSpec) -> str:
    """Markdown in the paper's layout: methods down, column-axis values across, groups side by side.

    Each cell is the mean final accuracy over seeds (± 95% CI half-width with several seeds), then
    the paper's number and our difference where the paper has the cell; the best of each column is bold.
    Where runs had held-out clients (never trained), each column is followed by their final accuracy.
    """
    return _paper_table(rows, spec)[0]


def _paper_table(rows: Sequence[Row], spec: TableSpec, score: str = "test") -> tuple[str, dict[str, PaperMatch]]:
    """The table and the paper's counterpart of each cell, labelled "row header" (none for a validation
    table: the paper has no validation numbers)."""
    data = TableData.of(rows, spec, score)
    slots = [(group, values) for group in data.groups for values in data.columns]
    matches = (
        {
            f"{row} {data.header(*slot)}": paper_match(data.cell_rows(row, *slot))
            for row in data.rows
            for slot in slots
            if data.cell_rows(row, *slot)
        }
        if score == "test"
        else {}
    )
    with_paper = _with_paper(matches)
    held = data.has_heldout
    headers = [data.header(*slot) + (f" | {data.header(*slot)} held-out" if held else "") for slot in slots]
    lines = [
        "| " + spec.rows + " | " + " | ".join(headers) + " |",
        "|---|" + "---|" * len(slots) * (2 if held else 1),
    ]
    metric = rows_metric(rows)
    pick = min if metric in LOWER_IS_BETTER else max  # the best: the lowest RMSE, the highest accuracy
    best = {}
    for slot in slots:
        means = [_mean(data.cell(row, *slot)) for row in data.rows]
        best[slot] = pick((mean for mean in means if math.isfinite(mean)), default=math.nan)
    for row in data.rows:
        cells = []
        for slot in slots:
            values = data.cell(row, *slot)
            text = format_accuracy(_mean(values), confidence_half_width(values)) if values else "—"
            text = f"**{text}**" if values and _mean(values) == best[slot] else text
            if values and with_paper:
                paper, delta = _paper_cells(_mean(values), matches[f"{row} {data.header(*slot)}"], metric)
                text += f" (paper {paper}, {delta})" if paper != "—" else " (paper —)"
            cells.append(text)
            if held:
                heldout = data.heldout_cell(row, *slot)
                cells.append(format_accuracy(_mean(heldout), confidence_half_width(heldout)) if heldout else "—")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines), matches


def class_table(rows: Sequence[Row], spec: TableSpec) -> str:
    """Markdown of a per-class table: ``spec.classes`` down, each table cell of the spec's layout
    across, each cell the mean over seeds of the participants' final accuracy on that class, with
    the appendix's Table IX beside it where it prints that character for that method (EMNIST); "—"
    where a run did not score classes (per-class-accuracy off) or no client held one."""
    data = TableData.of(rows, TableSpec(spec.columns, spec.groups, spec.rows))
    slots = [(row, group, values) for row in data.rows for group in data.groups for values in data.columns]
    slots = [slot for slot in slots if data.cell_rows(*slot)]
    headers = [" ".join(part for part in (row, data.header(group, values) if spec.columns or spec.groups else "")
                        if part) for row, group, values in slots]  # fmt: skip
    lines = ["| class | " + " | ".join(headers) + " |", "|---|" + "---|" * len(slots)]
    for name in spec.classes:
        cells = []
        for slot in slots:
            finals = data.cell_rows(*slot)
            values = [as_float(final.get(class_column(name), "")) for final in finals]
            scored = any(math.isfinite(value) for value in values)
            text = format_accuracy(_mean(values), confidence_half_width(values)) if scored else "—"
            paper = character_value(finals[0], name)
            cells.append(text + (f" (paper {paper:.3f})" if scored and paper is not None else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_figure(rows: Sequence[Row], spec: TableSpec, path: Path, title: str, score: str = "test") -> Path:
    """The table as a figure: final accuracy vs the column axis, one line per method, one panel per group."""
    plt = _figure()
    data = TableData.of(rows, spec, score)
    figure, panels = plt.subplots(1, len(data.groups), figsize=(5 * len(data.groups) + 1, 4.5), squeeze=False,
                                  sharey=True)  # fmt: skip
    x = np.arange(len(data.columns))
    for panel, group in zip(panels[0], data.groups, strict=True):
        for row in data.rows:
            cells = [data.cell(row, group, values) for values in data.columns]
            spread = [confidence_half_width(cell) if len(cell) > 1 else 0.0 for cell in cells]
            panel.errorbar(x, [_mean(cell) for cell in cells], yerr=spread, marker="o", capsize=3, label=row)
        panel.set_xticks(x, [", ".join(values) for values in data.columns])
        panel.set_xlabel(", ".join(data.axis_names))
        panel.set_title(group or title)
        panel.set_ylim(0, 1)
        panel.grid(alpha=0.3)
    panels[0][0].set_ylabel(f"final mean client {score} accuracy")
    panels[0][-1].legend(loc="lower left", fontsize="small")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def tables_markdown(rows: Sequence[Row], specs: Sequence[TableSpec], title: str, out: Path) -> str:
    """``tables.md`` with every table of a sweep, each followed by its figure (``table-N.png``)."""
    parts = [f"# {title}", ""]
    if rows:
        parts += [
            f"Cells: final-round mean client test {rows_metric(rows)}, mean over seeds (± 95% Student-t "
            "half-width with",
            "several seeds); bold marks the best method of each column.",
        ]
    for number, spec in enumerate(specs, start=1):
        if spec.classes:  # a per-class table: no figure; Table IX beside EMNIST cells (class_table)
            table = class_table(rows, spec) if rows else "(no runs)"
            parts += ["", f"## {spec.title or f'Table {number}'}", "", table, "",
                      "Cells: the participants' final accuracy on each class, mean over seeds (paper: Table IX, "
                      "for EMNIST)."]  # fmt: skip
            continue
        figure = table_figure(rows, spec, out / f"table-{number}.png", spec.title or title) if rows else None
        table, matches = _paper_table(rows, spec) if rows else ("(no runs)", {})
        legend = [*seeds_lines(rows, spec), *paper_legend(rows, matches)] if rows else []
        parts += ["", f"## {spec.title or f'Table {number}'}", "", table, *legend_markdown(legend)]
        if figure:
            parts += ["", f"![{spec.title or f'Table {number}'}]({figure.name})"]
        if has_validation(rows):
            heading = spec.title or f"Table {number}"
            parts += validation_section(rows, spec, heading, out / f"table-{number}-validation.png")
    return "\n".join(parts) + "\n"


def has_validation(rows: Sequence[Row]) -> bool:
    """Whether some run held out validation data (``validation-fraction``) and scored it."""
    return any(math.isfinite(as_float(row.get(SCORES["validation"][0], ""))) for row in rows)


def validation_section(rows: Sequence[Row], spec: TableSpec, title: str, figure_path: Path) -> list[str]:
    """A table's twin on the validation share, what its settings are chosen on (no paper column: the
    paper has no validation numbers), with its figure."""
    heading = f"{title}, on validation"
    figure = table_figure(rows, spec, figure_path, heading, score="validation")
    table, _ = _paper_table(rows, spec, score="validation")
    legend = [
        *seeds_lines(rows, spec),
        "Cells: the final round's validation accuracy (validation-fraction: a held-out share of each client's "
        "training data, never trained on), what settings are chosen on; held-out columns: the newcomers' "
        "validation share; n/a: a run without validation.",
    ]
    return ["", f"## {heading}", "", table, *legend_markdown(legend), "", f"![{heading}]({figure.name})"]


def seeds_lines(rows: Sequence[Row], spec: TableSpec) -> list[str]:
    """How many seeds each cell of a paper-layout table holds: one count for the table, and the
    cells with fewer named."""
    data = TableData.of(rows, spec)
    counts = {
        f"{row}, {data.header(group, values)}": len(data.cell(row, group, values))
        for row in data.rows
        for group in data.groups
        for values in data.columns
        if data.cell(row, group, values)
    }
    if not counts:
        return []
    most = max(counts.values())
    fewer = {cell: count for cell, count in counts.items() if count < most}
    line = f"n: {most} seed{'s' * (most != 1)} a cell"
    if fewer:
        line += "; fewer in " + "; ".join(f"{cell} ({count})" for cell, count in fewer.items())
    return [line + "."]


def scenario_groups(rows: Sequence[Row], setting_columns: Sequence[str]) -> dict[tuple[str, ...], list[Row]]:
    """Rows of each distinct scenario point (everything but method and seed), in first-seen order."""
    groups: dict[tuple[str, ...], list[Row]] = {}
    for row in rows:
        groups.setdefault(tuple(row[column] for column in setting_columns), []).append(row)
    return groups


def render(out: Path, title: str, kind: str, specs: Sequence[TableSpec], setting_columns: Sequence[str],
           failures: Sequence[tuple[str, str]], drift_round: int = 0,
           run_label_columns: Sequence[str] = ()) -> str:  # fmt: skip
    """Write the reports of a results folder from its ``metrics.csv``; returns what to print.

    A comparison gets ``summary.md`` and ``convergence.png``, and with ``drift_round`` (its
    ``drift-round`` setting) the drifting clients' recovery table and ``drift.png``; a sweep gets
    ``tables.md`` with one figure per table, and ``summary.md`` with a ranked table and a
    convergence plot (``convergence-N.png``) per scenario point: ``setting_columns`` make a point,
    ``run_label_columns`` (a grid's method axes) name the runs within one.
    """
    rows = labelled_runs(read_metrics(out / "metrics.csv"), run_label_columns)
    if kind == "compare":
        recoveries = drift_recoveries(rows, drift_round) if rows else []
        (out / "summary.md").write_text(summary_markdown(rows, title, failures, recoveries, drift_round))
        if rows:
            convergence_plot(rows, out / "convergence.png", f"{title}: {scenario_line(rows)}")
        if recoveries:
            drift_plot(rows, out / DRIFT_FIGURE, f"{title}: the drifting clients", drift_round)
        text = "\n".join(ranked_section(rows)) if rows else "no run finished"
        return text + ("\n\n" + "\n".join(drift_table(recoveries, drift_round)) if recoveries else "")
    sections = [f"# {title}: every scenario point", ""]
    for number, point_rows in enumerate(scenario_groups(rows, setting_columns).values(), start=1):
        labels = ", ".join(f"{c}={point_rows[0][c]}" for c in setting_columns if point_rows[0][c] != "")
        figure = convergence_plot(point_rows, out / f"convergence-{number}.png", scenario_line(point_rows))
        sections += [f"## {labels}", "", *ranked_section(point_rows), "", f"![convergence]({figure.name})", ""]
    if failures:
        sections += ["Runs that did not finish:", ""] + [f"- `{name}`: {status}" for name, status in failures]
    (out / "summary.md").write_text("\n".join(sections) + "\n")
    tables = tables_markdown(rows, specs, title, out)
    (out / "tables.md").write_text(tables)
    return tables


# The first line of a generated reproduction report; a file without it holds hand-written prose.
GENERATED_MARKER = "<!-- generated by fedcond reproduction"
#: How every generated file's first line begins (another command's report: its first line names it).
GENERATED = "<!-- generated by "
NOTES_FILE = "reproduction-notes.md"


def reproduction_notes(out: Path, notes: Path | None, markers: Sequence[str] = (GENERATED_MARKER,)) -> Path:
    """The notes file a reproduction report at ``out`` links to (``notes``, else the one beside it).
    Refuses a missing one, and an ``out`` whose first line is none of ``markers``: prose written by
    hand, or a report another command generated (which its first line names), never overwritten."""
    notes_path = notes if notes is not None else out.parent / NOTES_FILE
    if not notes_path.is_file():
        raise FedcondError(
            f"no notes file {notes_path}; write the hand-written part of the report there or pass --notes"
        )
    text = out.read_text() if out.is_file() else None
    if text is not None and not text.startswith(tuple(markers)):
        if text.startswith(GENERATED):
            raise FedcondError(
                f"{out} was generated by another command, which its first line names; regenerate it with that one"
            )
        # Never overwrite prose: it belongs in the notes file, which the report links to.
        raise FedcondError(f"{out} was written by hand; move its prose into {notes_path}, then delete it")
    return notes_path


def with_variants(rows: Sequence[Row], settings: Mapping[str, object]) -> list[Row]:
    """Rows of a metrics.csv written before the tidy file named the fingerprint and conditioning:
    those come from the experiment's fixed settings, else they were the defaults."""
    filled = []
    for row in rows:
        missing = {key: str(settings.get(key, VARIANT_DEFAULTS[key])) for key in VARIANT_COLUMNS if not row.get(key)}
        filled.append({**row, **missing})
    return filled


def comparison_table(
    summaries: Sequence[MethodSummary], matches: Mapping[str, PaperMatch], metric: str = "accuracy"
) -> str:
    """Markdown: method | ours (mean ± 95% CI) | paper | Δ | [held-out clients] | seeds | time per run.

    The held-out column (clients that never trained, evaluated with the model a newcomer gets)
    appears when some run measured it: it tells a fingerprint that describes a distribution from
    one that identifies the training clients."""
    with_heldout = any(math.isfinite(s.final_heldout) for s in summaries)
    ours = "ours" if metric == "accuracy" else f"ours ({metric})"
    header = ["method", ours, "paper", "Δ", *(["held-out clients"] * with_heldout), "seeds", "time per run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        cells = [
            s.method,
            format_accuracy(s.final_mean, s.final_half_width),
            *_paper_cells(s.final_mean, matches.get(s.method), metric),
            *([format_accuracy(s.final_heldout)] * with_heldout),
        ]
        cells += [str(s.seeds), format_duration(s.wall_seconds) if math.isfinite(s.wall_seconds) else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _link(path: Path, base: Path) -> str:
    """``path`` relative to the report's folder, with forward slashes (Markdown links)."""
    return Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()


def folder_section(folder: Path, base: Path) -> list[str]:
    """One results folder in the reproduction report: per scenario point, ours beside the paper's."""
    experiment = load_experiment(folder)
    metrics = folder / METRICS_FILE
    if not metrics.is_file():
        raise FedcondError(f"{folder} holds no {METRICS_FILE}; run fedcond report {folder} first")
    rows = labelled_runs(with_variants(read_metrics(metrics), experiment.settings),
                         [column_name(axis) for axis in experiment.method_axes])  # fmt: skip
    link = _link(folder, base)
    parts = [f"### {experiment.title}", "", f"Results folder [{link}]({link}): [tables]({link}/tables.md), "
             f"[summary]({link}/summary.md), every run's history.csv and run.json.", ""]  # fmt: skip
    if not rows:
        return [*parts, "No run has finished yet.", ""]
    setting_columns = [column_name(axis) for axis in experiment.point_axes]
    # The same grouping and numbering as render(), so the figure names match.
    points = [rows] if experiment.kind == "compare" else list(scenario_groups(rows, setting_columns).values())
    figures = [
        folder / ("convergence.png" if experiment.kind == "compare" else f"convergence-{number}.png")
        for number in range(1, len(points) + 1)
    ]
    # Axes beyond the standard settings (a fingerprint's encoder, say) are variants of one scenario
    # point: its variants share one table, a column each.
    standard_columns, variant_columns = setting_columns[: len(SETTING_COLUMNS)], setting_columns[len(SETTING_COLUMNS) :]
    scenarios: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for index, point_rows in enumerate(points):
        scenarios[tuple(point_rows[0][column] for column in standard_columns)].append(index)
    epochs = experiment.settings.get("local-epochs")
    for indices in scenarios.values():
        scenario_rows = [row for index in indices for row in points[index]]
        fractions, rounds = _budget(scenario_rows)
        seeds = sorted({row["seed"] for row in scenario_rows}, key=int)
        matches = paper_matches(scenario_rows)
        metric = rows_metric(scenario_rows)
        budget = f"{rounds} rounds" + (f" of {epochs} local epoch{'s' * (epochs != 1)}" if epochs else "")
        variants = {
            ", ".join(f"{column}={points[index][0][column]}" for column in variant_columns): points[index]
            for index in indices
        }
        if len(variants) == 1:
            heading = ", ".join([scenario_line(scenario_rows), *([*variants][0:1] if variant_columns else [])])
            table = comparison_table(summarise(scenario_rows), matches, metric)
        else:
            heading = scenario_line(scenario_rows)
            table = variant_table({label: summarise(rows) for label, rows in variants.items()}, matches, metric)
        figure_lines = [
            f"![convergence{f' ({label})' if len(variants) > 1 else ''}]({_link(figures[index], base)})"
            for label, index in zip(variants, indices, strict=True)
            if figures[index].is_file()
        ]
        if len(figure_lines) < len(indices):
            figure_lines.append("(no convergence figure yet: `fedcond report` on this folder draws it)")
        parts += [
            f"#### {heading}",
            "",
            f"{budget}, data fraction {', '.join(fractions)}, seeds {', '.join(seeds)}.",
            "",
            table,
            *legend_markdown(paper_legend(scenario_rows, matches)),
            "",
            *figure_lines,
            "",
        ]
    return parts


def variant_table(
    variants: Mapping[str, Sequence[MethodSummary]], matches: Mapping[str, PaperMatch], metric: str = "accuracy"
) -> str:
    """Markdown: method | paper | one column per variant of the scenario point (ours, Δ vs paper) | seeds.

    Methods in the order of the first variant's ranking, then those only later variants ran."""
    by_method: dict[str, dict[str, MethodSummary]] = defaultdict(dict)
    for label, summaries in variants.items():
        for summary in summaries:
            by_method[summary.method][label] = summary
    with_paper = _with_paper(matches)
    header = ["method", *(["paper"] * with_paper), *variants, "seeds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, cells_by_variant in by_method.items():
        match = matches.get(method)
        found = match is not None and match.found
        cells = [method, *([f"{match.value:.3f}" if found else "—"] * with_paper)]
        for label in variants:
            summary = cells_by_variant.get(label)
            if summary is None:
                cells.append("not run")
                continue
            delta = f" ({format_delta(summary.final_mean, match.value, metric)})" if found else ""
            cells.append(format_accuracy(summary.final_mean, summary.final_half_width) + delta)
        counts = sorted({summary.seeds for summary in cells_by_variant.values()})
        cells.append(" / ".join(str(summary.seeds) for summary in cells_by_variant.values()) if len(counts) > 1
                     else str(counts[0]))  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reproduction_markdown(
    folders: Sequence[Path],
    notes: Path,
    command: str,
    base: Path,
    verdicts: Sequence[str] = (),
    marker: str = GENERATED_MARKER,
) -> str:
    """The reproduction report: a link to the hand-written ``notes`` (the discussion, kept in one
    place), the ``verdicts`` section (a checkout's claims: tools/reproduction.py), then every folder's
    results beside the paper's (links relative to ``base``, the report's folder). Its first line is
    ``marker`` and the ``command`` that regenerates it."""
    do_not_edit = f"do not edit; regenerate with `{command}`"
    parts = [
        f"{marker}: {do_not_edit} -->",
        "",
        "# Our results beside the paper's (generated)",
        "",
        f"What these results say about each of the paper's claims, and why ours differ where they do, is "
        f"written in [{notes.name}]({_link(notes, base)}); this page is generated from the results folders "
        f"below ({do_not_edit}). Ours: final-round mean client test accuracy, the mean over seeds ± the 95% "
        "Student-t half-width with several seeds. Paper: the paper's number for the same setting "
        "(experiments/paper/results.md); Δ: ours minus paper, in accuracy points (a regression task's: its "
        "RMSE, lower is better, and the difference in RMSE). Time per run: mean wall time of one run on the "
        "machine that ran it.",
        "",
        *verdicts,
    ]
    for folder in folders:
        parts += folder_section(folder, base)
    return "\n".join(parts).rstrip() + "\n"
