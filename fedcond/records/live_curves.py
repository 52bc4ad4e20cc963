"""Live curves: TensorBoard event files that a run writes into its own folder as each round ends.

``tensorboard --logdir <a run, compare or sweep folder>`` then shows every run below it as one
TensorBoard run (named by its folder), each tag one chart with every method and seed in it, and
redraws while the rounds go on. The writer is PyTorch's ``SummaryWriter`` over the ``tensorboard``
package's own event-file writer; a round costs it well under a millisecond (docs/performance.md).
The event files are a view of ``history.csv``, which stays the record: every value written here is
one of its columns, and a missing value (NaN: no newcomers, no drift) is left out, not drawn as zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedcond.config import Option

LIVE_CURVES = Option(
    "live-curves",
    True,
    "write TensorBoard event files into the run's folder as each round ends, for `tensorboard --logdir "
    "<results folder>` to show every run's curves while it runs; false: none",
)

#: Chart (TensorBoard tag) -> the history column it draws, for the score's name ``{metric}``
#: (accuracy, or rmse on a regression task). One table: the test reads it against history.csv.
CHARTS: dict[str, str] = {
    "{metric}/mean": "accuracy",
    "{metric}/worst client": "worst_accuracy",
    "{metric}/p10 client": "p10_accuracy",
    "newcomers/{metric}": "heldout_accuracy",
    "newcomers/worst {metric}": "heldout_worst_accuracy",
    "newcomers/adapted {metric}": "heldout_adapted_accuracy",
    "drift/drifting clients' {metric}": "drifted_accuracy",
    "loss/test": "loss",
    "loss/train": "train_loss",
    "traffic/MB down": "bytes_down",
    "traffic/MB up": "bytes_up",
    "clients/answered": "clients_answered",
    "clustering/ARI": "ari",
    "privacy/epsilon": "epsilon",
    "time/round seconds": "seconds",
}
#: Columns drawn in another unit than history.csv's: bytes as MB.
SCALE = {"bytes_down": 1e-6, "bytes_up": 1e-6}
#: Where the event files go: the run's own folder, so the run's name in TensorBoard is its folder's.
EVENT_FILE_PREFIX = "events.out.tfevents."


def chart_values(record: Any, metric: str) -> dict[str, float]:
    """The values one round (a ``fedcond.records.history.RoundRecord``, which imports this module) draws, by
    chart; NaN (nothing to draw) left out."""
    values = {}
    for chart, column in CHARTS.items():
        value = float(getattr(record, column)) * SCALE.get(column, 1.0)
        if math.isfinite(value):
            values[chart.format(metric=metric)] = value
    for cluster, accuracy in sorted(record.cluster_accuracy.items()):
        if math.isfinite(accuracy):
            values[f"clusters/{metric} of cluster {cluster}"] = accuracy
    return values


def settings_text(settings: Mapping[str, Any]) -> str:
    """The run's settings as the Markdown table TensorBoard's Text tab shows."""
    rows = "\n".join(f"| {key} | {value} |" for key, value in sorted(settings.items()))
    return f"| setting | value |\n|---|---|\n{rows}"


class LiveCurves:
    """One run's event files: its settings once, then every round's values as the round ends."""

    def __init__(self, folder: Path, settings: Mapping[str, Any], metric: str) -> None:
        # Imported here: a run with live-curves=false never loads TensorBoard.
        from torch.utils.tensorboard import SummaryWriter

        self.metric = metric
        self.writer = SummaryWriter(log_dir=str(folder))
        self.writer.add_text("settings", settings_text(settings))

    def add(self, record: Any) -> None:
        for chart, value in chart_values(record, self.metric).items():
            self.writer.add_scalar(chart, value, record.round)
        # Written through now rather than every two minutes: the chart updates as the round ends.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
