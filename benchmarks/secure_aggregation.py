"""SecAgg+ against plain aggregation: accuracy, bytes and seconds per round, and a mid-protocol dropout.

    python benchmarks/secure_aggregation.py --out results/secagg                  # every setting below
    python benchmarks/secure_aggregation.py --out DIR --only fedavg,fedavg-secagg  # some of them
    python benchmarks/secure_aggregation.py --out DIR --table                      # the table, from DIR
    python benchmarks/secure_aggregation.py --out DIR num-server-rounds=5          # other settings

Each setting is one in-process Flower simulation (``fedcond.tools.simulation.simulate``, the path
``fedcond compare`` takes) into ``OUT/<name>/``; a finished one is not run again. ``--table`` prints
per pair (plain, SecAgg+): final accuracy of each, the largest per-round accuracy difference, median
bytes down and up per round, median seconds per round after the first, and the one-off bytes of the
fingerprint statistics' sum; then each dropout run's round with the dropout (clients answered,
accuracy) and its failures as run.json lists them.

``*-dropout`` settings make one client (partition 1) raise in round 2 at SecAgg+'s
``collect_masked_vectors`` stage (before its masked vector is sent: left out of the sum) or
``unmask`` stage (after: its vector is in the sum, its masks are rebuilt from the others' shares).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import ray.cloudpickle
from flwr.app import Message
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Context
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from fedcond.federation.methods import run_config
from fedcond.records.history import run_status
from fedcond.tools.flwr_commands import parse_assignments
from fedcond.tools.simulation import simulate

# Ray actors unpickle the ClientApp, mods included: by value (benchmarks/ is no package they import).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SECAGG = {"secure-aggregation": "secaggplus"}
# name -> (run-config settings on top of the command line's, the SecAgg+ stage partition 1 fails in round 2).
SETTINGS: dict[str, tuple[dict[str, object], str]] = {
    "fedavg": ({"method": "fedavg"}, ""),
    "fedavg-secagg": ({"method": "fedavg", **SECAGG}, ""),
    "conditional": ({"method": "conditional"}, ""),
    "conditional-secagg": ({"method": "conditional", **SECAGG}, ""),
    "fedavg-secagg-dropout-collect": ({"method": "fedavg", **SECAGG}, "collect_masked_vectors"),
    "fedavg-secagg-dropout-unmask": ({"method": "fedavg", **SECAGG}, "unmask"),
}
PAIRS = (("fedavg", "fedavg-secagg"), ("conditional", "conditional-secagg"))
DROPOUT_ROUND, DROPOUT_PARTITION = 2, 1


@dataclass(frozen=True)
class DropOut:
    """A Flower mod: partition ``partition`` raises at SecAgg+'s ``stage`` of round ``server_round``."""

    partition: int
    server_round: int
    stage: str

    def __call__(self, message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        configs = message.content.config_records.get(RECORD_KEY_CONFIGS) if message.has_content() else None
        if (
            configs is not None
            and configs.get(Key.STAGE) == self.stage
            and message.metadata.group_id == str(self.server_round)
            and int(context.node_config["partition-id"]) == self.partition
        ):
            raise RuntimeError(f"partition {self.partition} dropped out at {self.stage} in round {self.server_round}")
        return call_next(message, context)


def run(name: str, out: Path, extra: dict[str, object]) -> None:
    folder = out / name
    if run_status(folder) == "finished":
        print(f"{name}: finished before, kept", flush=True)
        return
    settings, stage = SETTINGS[name]
    config = run_config({**extra, **settings, "results-dir": str(out), "run-name": name, "verbose": False})
    mods = [DropOut(DROPOUT_PARTITION, DROPOUT_ROUND, stage)] if stage else []
    simulate(config, client_mods=mods, quiet=True)
    print(f"{name}: {run_status(folder)}", flush=True)


def history(folder: Path) -> list[dict[str, str]]:
    with (folder / "history.csv").open() as handle:
        return list(csv.DictReader(handle))


def per_round(rows: list[dict[str, str]], column: str) -> float:
    return statistics.median(float(row[column]) for row in rows[1:] or rows)


def table(out: Path) -> str:
    lines = [
        "| method | final accuracy plain / SecAgg+ | largest per-round accuracy difference | bytes down per round "
        "plain / SecAgg+ | bytes up per round plain / SecAgg+ | seconds per round plain / SecAgg+ | "
        "statistics sum bytes plain / SecAgg+ |",
        "|---|---|---|---|---|---|---|",
    ]
    for plain_name, secure_name in PAIRS:
        if not all(run_status(out / name) == "finished" for name in (plain_name, secure_name)):
            continue
        plain, secure = history(out / plain_name), history(out / secure_name)
        infos = [json.loads((out / name / "run.json").read_text()) for name in (plain_name, secure_name)]
        difference = max(abs(float(a["accuracy"]) - float(b["accuracy"])) for a, b in zip(plain, secure, strict=True))
        cells = [
            f"{float(plain[-1]['accuracy']):.4f} / {float(secure[-1]['accuracy']):.4f}",
            f"{difference:.4f}",
            f"{per_round(plain, 'bytes_down'):,.0f} / {per_round(secure, 'bytes_down'):,.0f}",
            f"{per_round(plain, 'bytes_up'):,.0f} / {per_round(secure, 'bytes_up'):,.0f}",
            f"{per_round(plain, 'seconds'):.2f} / {per_round(secure, 'seconds'):.2f}",
            " / ".join(f"{info['secure_sum_bytes']:,}" for info in infos),
        ]
        lines.append(f"| {plain_name} | " + " | ".join(cells) + " |")
    for name, (_, stage) in SETTINGS.items():
        if not stage or run_status(out / name) != "finished":
            continue
        rows = history(out / name)
        before, row = rows[DROPOUT_ROUND - 2], rows[DROPOUT_ROUND - 1]
        failures = json.loads((out / name / "run.json").read_text())["failures"]
        lines.append(
            f"\n{name}: round {row['round']} answered {row['clients_answered']}/{row['clients_asked']}, accuracy "
            f"{float(row['accuracy']):.4f} (round {before['round']}: {float(before['accuracy']):.4f}, "
            f"final {float(rows[-1]['accuracy']):.4f}, {len(rows)} rounds); failures: {json.dumps(failures)}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="", help="comma-separated setting names (default: all)")
    parser.add_argument("--table", action="store_true", help="print the table from --out, run nothing")
    parser.add_argument("settings", nargs="*", help="run-config key=value for every run")
    args = parser.parse_args()
    if not args.table:
        names = [name for name in args.only.split(",") if name] or list(SETTINGS)
        unknown = sorted(set(names) - set(SETTINGS))
        if unknown:
            raise SystemExit(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
        args.out.mkdir(parents=True, exist_ok=True)
        for name in names:
            run(name, args.out, parse_assignments(args.settings))
    print(table(args.out))


if __name__ == "__main__":
    main()
