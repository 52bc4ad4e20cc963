"""What Flower costs on top of the training itself: the framework against a bare loop, one invocation.

    python benchmarks/overhead.py --quick                      # tiny digits smoke workload (~1 min)
    python benchmarks/overhead.py --workload clients-10 --data-dir DIR
    python benchmarks/overhead.py --workload all --data-dir DIR --out benchmarks/results
    python benchmarks/overhead.py --parts flwr-run --set live-curves=false ...   # a setting's cost

For each workload it runs, one after the other, each as its own process tree:

- ``bare``: a single-process PyTorch loop doing the same federated SGD steps (same CNN, data split,
  batch order, FedAvg in partition order, every client evaluating every round, ``--threads``
  threads). It lives here, not in the package: it is the yardstick.
- ``flwr-run``: ``fedcond run method=fedavg ...`` (``flwr run`` with a local SuperLink of its own).
- ``simulation`` (optional, ``--parts``): fedcond's in-process simulation (``run_simulation``).
- ``floor``: Flower's own floor, a minimal app (a 1-number model, no torch) through ``flwr run``
  with the same number of SuperNodes and rounds.

and prints: the whole command, per round, round 1 vs round 2, start-up and shut-down outside the
rounds, per-message overhead, the peak memory (PSS and RSS) of the whole process tree (the
SuperLink and its Ray workers included), and whether bare loop and framework reached the same accuracy. Results go to
``--out`` as ``overhead.json``, ``overhead.csv`` and ``overhead.png`` (round time and peak memory
against the number of clients). See docs/performance.md for what each number means.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil

# The checkout (the benchmark needs fedcond installed, as `make` does; run it with the venv's python).
ROOT = Path(__file__).resolve().parents[1]

#: A workload's client-state-dir placeholder: replaced by a folder inside --out.
CLIENT_STATE_HERE = "<out>/client-state"
#: name -> run-config settings (all E1, label shift, FedAvg) and the number of rounds.
WORKLOADS: dict[str, dict[str, object]] = {
    "quick": {"dataset": "digits", "num-clusters": 2, "clients-per-cluster": 2, "data-fraction": 1.0,
              "num-server-rounds": 2},
    "clients-10": {"dataset": "mnist", "num-clusters": 5, "clients-per-cluster": 2, "data-fraction": 0.2,
                   "num-server-rounds": 5},
    "clients-100": {"dataset": "mnist", "num-clusters": 10, "clients-per-cluster": 10, "data-fraction": 1.0,
                    "num-server-rounds": 3},
    "clients-1000": {"dataset": "mnist", "num-clusters": 10, "clients-per-cluster": 100, "data-fraction": 1.0,
                     "num-server-rounds": 3},
    # The same federation, 100 clients a round: the bare loop trains the same sample and scores each
    # round's model on the clients fedcond scores it with (the next round's sample; everyone at the end).
    "sampled-1000": {"dataset": "mnist", "num-clusters": 10, "clients-per-cluster": 100, "data-fraction": 1.0,
                     "num-server-rounds": 5, "clients-per-round": 100, "evaluate-every": 5},
    # The sparsity grids' largest federation (E1 K=2 x 100, MNIST), with the paper's method: flwr-run
    # (and floor) only, since the bare loop is FedAvg's.
    "sparsity-200": {"dataset": "mnist", "num-clusters": 2, "clients-per-cluster": 100, "data-fraction": 1.0,
                     "num-server-rounds": 3, "method": "conditional"},
    # 10,000 virtual clients, 100 a round (flwr-run only: the bare loop is FedAvg's). E1 K=10 x
    # 1,000 on Fashion-MNIST, whose test split has 1,000 images of each class, one per client (MNIST's
    # 980 zeros leave client 980 of that cluster none). The paper's method without the federated
    # statistics' set-up sum (four SecAgg+ messages per client, 40,000 before round 1): log-normalised.
    "sampled-10000-conditional": {"dataset": "fashion-mnist", "num-clusters": 10, "clients-per-cluster": 1000,
                                  "data-fraction": 1.0, "num-server-rounds": 5, "clients-per-round": 100,
                                  "evaluate-every": 5, "method": "conditional", "normalisation": "log"},
    # Ditto's personal models go to files (client-state-dir: a folder of the benchmark's own, set in
    # run_framework), not to the context.state Flower's simulation holds for every virtual node.
    "sampled-10000-ditto": {"dataset": "fashion-mnist", "num-clusters": 10, "clients-per-cluster": 1000,
                            "data-fraction": 1.0, "num-server-rounds": 5, "clients-per-round": 100,
                            "evaluate-every": 5, "method": "ditto", "client-state-dir": CLIENT_STATE_HERE},
}  # fmt: skip
#: What ``--workload all`` runs: the three federation sizes of the overhead table.
ALL_WORKLOADS = ("clients-10", "clients-100", "clients-1000")
PARTS = ("bare", "flwr-run", "simulation", "floor")
SAMPLE_SECONDS = 0.2


# -- measuring a process tree ------------------------------------------------------------------------
@dataclass
class Measured:
    """One command: its wall time, its output lines with the time each arrived, its peak tree RSS."""

    command: list[str]
    seconds: float = 0.0
    returncode: int = 0
    peak_rss_bytes: int = 0
    peak_pss_bytes: int = 0
    #: At the PSS peak: each process's short name and PSS, largest first (where the memory is).
    peak_breakdown: list[tuple[str, int]] = field(default_factory=list)
    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, text)


def short_name(process: psutil.Process) -> str:
    """``ray::ClientAppActor``, ``flower-superlink``, ``python -m fedcond.tools.cli``: enough to tell them apart."""
    with contextlib.suppress(psutil.Error):
        cmdline = process.cmdline()
        if not cmdline:  # a process exiting (or a zombie) between the listing and this call
            return "?"
        if cmdline[0].startswith("ray::"):
            return cmdline[0]
        # File names without their folders: the breakdown is compared between machines.
        words = [Path(word).name if word.startswith("/") else word
                 for word in cmdline[:3] if not word.startswith("--")]  # fmt: skip
        return " ".join(words)[:60]
    return "?"


def tree_memory(roots: list[psutil.Process]) -> dict[int, tuple[int, int]]:
    """pid -> (RSS, PSS) of ``roots`` and all their descendants. RSS counts a shared page (torch's
    libraries in every Ray worker) once per process; PSS splits it among them, so its sum is what
    the tree adds to the machine (Linux; elsewhere PSS falls back to RSS)."""
    seen: dict[int, tuple[int, int]] = {}
    for root in roots:
        try:
            members = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for process in members:
            if process.pid in seen:
                continue
            with contextlib.suppress(psutil.Error):  # it may have exited since it was listed
                info = process.memory_full_info()
                seen[process.pid] = (info.rss, getattr(info, "pss", info.rss))
    return seen


def detached_roots(marker: str) -> list[psutil.Process]:
    """Processes outside our tree that belong to this measurement (the detached local SuperLink)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if any(marker in part for part in cmdline):
            found.append(process)
    return found


def measure(command: list[str], env: dict[str, str], cwd: Path, marker: str = "") -> Measured:
    """Run ``command``, timestamping each output line and sampling the tree's memory every 0.2 s."""
    result = Measured(command)
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace")  # fmt: skip
    root = psutil.Process(process.pid)
    done = threading.Event()

    def sample() -> None:
        extra: list[psutil.Process] = []
        while not done.is_set():
            if marker and not extra:
                extra = detached_roots(marker)
            members = tree_memory([root, *extra])
            result.peak_rss_bytes = max(result.peak_rss_bytes, sum(rss for rss, _ in members.values()))
            pss = sum(pss for _, pss in members.values())
            if pss > result.peak_pss_bytes:
                result.peak_pss_bytes = pss
                named = [(short_name(psutil.Process(pid)) if psutil.pid_exists(pid) else "?", p)
                         for pid, (_, p) in members.items()]  # fmt: skip
                result.peak_breakdown = sorted(named, key=lambda item: -item[1])
            done.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    assert process.stdout is not None
    for line in process.stdout:
        result.lines.append((time.perf_counter() - start, line.rstrip()))
    result.returncode = process.wait()
    result.seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return result


# -- what each part reports ----------------------------------------------------------------------------
@dataclass
class PartResult:
    part: str
    workload: str
    num_clients: int
    rounds: int
    whole_seconds: float
    round_seconds: list[float]
    startup_seconds: float
    shutdown_seconds: float
    peak_rss_bytes: int
    peak_pss_bytes: int
    final_accuracy: float | None = None
    returncode: int = 0
    note: str = ""
    peak_breakdown: list[tuple[str, int]] = field(default_factory=list)

    @property
    def steady_round(self) -> float:
        """Mean of the steady rounds (``steady_rounds``)."""
        later = steady_rounds(self.round_seconds)
        return float(np.mean(later)) if later else float("nan")


def steady_rounds(rounds: list[float]) -> list[float]:
    """Rounds 2 to the one before the last (round 1 holds one-off work; the last also sends the run's
    closing evaluate messages under evaluate-in-fit): rounds 2.. with fewer than 3, round 1 with one."""
    return rounds[1:-1] if len(rounds) >= 3 else (rounds[1:] or rounds)


def split_outside(whole: float, round_seconds: list[float], last_end: float) -> tuple[float, float]:
    """Start-up (command start to round 1's start) and shut-down (last round's end to exit). Shut-down
    is from the time the last round's line arrived; start-up is the rest of the time outside the
    rounds (a round's line can arrive a round late: evaluate-in-fit writes round r's row when round
    r+1's fit replies bring its evaluations, so round 1's line does not say when round 1 ended)."""
    shutdown = max(whole - last_end, 0.0)
    return max(whole - sum(round_seconds) - shutdown, 0.0), shutdown


def part_result(
    part: str,
    workload: str,
    clients: int,
    measured: Measured,
    round_seconds: list[float],
    round_ends: list[float],
    accuracy: float | None,
) -> PartResult:
    """A part's numbers from its command's measurement, its rounds' durations and the times (seen
    by this process) at which each round's line arrived."""
    complete = bool(round_seconds) and len(round_ends) == len(round_seconds)
    startup, shutdown = split_outside(measured.seconds, round_seconds, round_ends[-1]) if complete else (0.0, 0.0)
    note = "" if complete else "rounds missing; last lines: " + " | ".join(line for _, line in measured.lines[-5:])
    memory = (measured.peak_rss_bytes, measured.peak_pss_bytes)
    return PartResult(part, workload, clients, len(round_seconds), measured.seconds, round_seconds, startup, shutdown,
                      *memory, accuracy, measured.returncode, note, measured.peak_breakdown)  # fmt: skip


# -- (a) the bare loop ----------------------------------------------------------------------------------
def fedavg(models: Iterable[list[np.ndarray]], counts: list[int]) -> list[np.ndarray]:
    """FedAvg as Flower computes it (each model scaled by its sample share in its own dtype, then summed
    in order), consuming one model at a time: the loop never holds a round's models all at once."""
    total = float(sum(counts))
    result: list[np.ndarray] = []
    for index, (model, count) in enumerate(zip(models, counts, strict=True)):
        share = np.float64(count / total)
        scaled = [
            (layer * share).astype(layer.dtype) if np.can_cast(share, layer.dtype, casting="same_kind")
            else layer * np.array(share, layer.dtype)  # an integer buffer (batch norm's step count)
            for layer in model
        ]  # fmt: skip
        result = scaled if index == 0 else [a + b for a, b in zip(result, scaled, strict=True)]
    return result


def round_seed(seed: int, server_round: int, partition_id: int) -> int:
    """A client's batch-order seed, by the rule of ``FedcondClient.round_seed``."""
    return int(np.random.SeedSequence([seed, server_round, partition_id]).generate_state(1)[0])


def bare_loop(settings: dict[str, object], threads: int) -> dict[str, object]:
    """The same federated SGD steps as fedcond's FedAvg, in one process: the yardstick."""
    import torch

    from fedcond.data.client_data import load_client_data
    from fedcond.data.scenarios import scenario_for
    from fedcond.federation.methods import run_config
    from fedcond.federation.sampling import CLIENTS_PER_ROUND, evaluates_everyone, sample_partitions
    from fedcond.model.networks import build_run_model, get_weights, set_weights
    from fedcond.model.training import TrainSettings, evaluate, train
    from fedcond.tools.flwr_commands import default_config

    torch.set_num_threads(threads)
    # The app's defaults under the workload's settings, exactly as `fedcond run` composes them.
    config = run_config({**default_config(), **settings, "method": "fedavg"}).resolved()
    scenario = scenario_for(config)
    clients = [load_client_data(config, pid) for pid in range(config.num_clients)]
    model = build_run_model(config, scenario.num_classes, conditioned=False)
    global_weights = get_weights(model)
    train_settings = TrainSettings.of(config)
    rounds: list[dict[str, float]] = []
    everyone = range(config.num_clients)

    def sample(server_round: int) -> list[int]:  # fedcond's sample (fedcond.federation.sampling), or everyone
        return sample_partitions(config.seed, server_round, everyone, CLIENTS_PER_ROUND.of(config))

    for server_round in range(1, config.num_server_rounds + 1):
        start = time.perf_counter()
        trained = [clients[pid] for pid in sample(server_round)]

        def updates(
            current: list[np.ndarray], server_round: int = server_round, trained: list = trained
        ) -> Iterator[list[np.ndarray]]:
            for data in trained:
                set_weights(model, current)
                seed = round_seed(config.seed, server_round, data.partition_id)
                train(model, data.train_x, data.train_y, None, train_settings, seed)
                yield get_weights(model)

        global_weights = fedavg(updates(global_weights), [len(data.train_y) for data in trained])
        set_weights(model, global_weights)
        # The clients fedcond scores this round's model with: everyone, or the next round's sample.
        scorers = everyone if evaluates_everyone(config, server_round) else sample(server_round + 1)
        scored = [clients[pid] for pid in scorers]
        correct = sum(evaluate(model, d.test_x, d.test_y, None).accuracy * len(d.test_y) for d in scored)
        accuracy = correct / sum(len(d.test_y) for d in scored)
        rounds.append({"seconds": time.perf_counter() - start, "accuracy": accuracy})
        print(f"bare: round {server_round} {rounds[-1]['seconds']:.2f} s accuracy {accuracy:.4f}", flush=True)
    return {"rounds": rounds}


def run_bare(workload: str, settings: dict[str, object], threads: int, out: Path) -> PartResult:
    report = out / f"bare-{workload}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "bare-loop", "--settings", json.dumps(settings),
               "--threads", str(threads), "--report", str(report)]  # fmt: skip
    measured = measure(command, child_environment(threads), out)
    rounds = json.loads(report.read_text())["rounds"] if report.is_file() else []
    seconds = [r["seconds"] for r in rounds]
    ends = [t for t, line in measured.lines if line.startswith("bare: round")]
    accuracy = rounds[-1]["accuracy"] if rounds else None
    return part_result("bare", workload, num_clients(settings), measured, seconds, ends, accuracy)


# -- (b) the framework -----------------------------------------------------------------------------------
ROUND_LINE = re.compile(r"^round +(\d+)/(\d+)")
RESULTS_LINE = re.compile(r"results in (\S+)")


def run_framework(workload: str, settings: dict[str, object], threads: int, out: Path, part: str) -> PartResult:
    """``fedcond run`` (``part == "flwr-run"``) or the in-process simulation (``"simulation"``)."""
    runs = out / "runs"
    name = f"{part}-{workload}-{int(time.time())}"
    assignments = [f"{key}={value}" for key, value in {"method": "fedavg", **settings, "verbose": "true"}.items()]
    assignments += [f"results-dir={runs}", f"run-name={name}"]
    home = out / "flwr-home"
    environment = flower_home_environment(home, threads)
    if part == "flwr-run":
        command = [sys.executable, "-m", "fedcond.tools.cli", "run", *assignments]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "simulate", *assignments]
    marker = f"127.0.0.1:{environment['FLWR_LOCAL_CONTROL_API_PORT']}" if part == "flwr-run" else ""
    try:
        measured = measure(command, environment, out, marker)
    finally:
        stop_superlink(marker)
    folder = runs / name
    history = read_csv(folder / "history.csv")
    seconds = [float(row["seconds"]) for row in history]
    ends = [t for t, line in measured.lines if ROUND_LINE.match(line)]
    accuracy = float(history[-1]["accuracy"]) if history else None
    return part_result(part, workload, num_clients(settings), measured, seconds, ends, accuracy)


def simulate_main(assignments: list[str]) -> int:
    """The ``simulate`` part: fedcond's in-process simulation of the same run, in this process."""
    from fedcond.federation.checks import check_run
    from fedcond.federation.methods import run_config
    from fedcond.tools.flwr_commands import default_config, parse_assignments
    from fedcond.tools.simulation import simulate

    config = run_config({**default_config(), **parse_assignments(assignments)})
    check_run(config, load_data=True)
    simulate(config, quiet=True)
    return 0


# -- (c) Flower's floor ------------------------------------------------------------------------------------
FLOOR_PYPROJECT = """\
[project]
name = "flowerfloor"
version = "1.0.0"

[tool.flwr.app]
publisher = "benchmark"

[tool.flwr.app.components]
serverapp = "floor_app:server"
clientapp = "floor_app:client"

[tool.flwr.app.config]
num-server-rounds = 2
num-supernodes-hint = 2
clients-per-round-hint = 0
"""
FLOOR_APP = '''\
"""The smallest federated app: a one-number model, FedAvg, one message per client per round (a fit whose
reply would carry the evaluation, as fedcond's evaluate-in-fit does)."""

import time

import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.common import ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg


class Floor(NumPyClient):
    def fit(self, parameters, config):
        return parameters, 1, {}

    def evaluate(self, parameters, config):
        return 0.0, 1, {}


class TimedFedAvg(FedAvg):
    def configure_fit(self, server_round, parameters, client_manager):
        self.round_start = time.perf_counter()
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        aggregated = super().aggregate_fit(server_round, results, failures)
        print(f"round {server_round}/x seconds {time.perf_counter() - self.round_start:.4f}", flush=True)
        return aggregated


def server_fn(context):
    clients = int(context.run_config.get("num-supernodes-hint", 2))
    per_round = int(context.run_config.get("clients-per-round-hint", 0)) or clients  # Flower's own sampler
    strategy = TimedFedAvg(fraction_fit=per_round / clients, fraction_evaluate=0.0, min_available_clients=clients,
                           min_fit_clients=per_round, min_evaluate_clients=0,
                           initial_parameters=ndarrays_to_parameters([np.zeros(1)]))
    rounds = int(context.run_config["num-server-rounds"])
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))


server = ServerApp(server_fn=server_fn)
client = ClientApp(client_fn=lambda context: Floor().to_client())
'''
FLOOR_SECONDS = re.compile(r"round +\d+/x seconds ([0-9.]+)")


def messages_per_round(settings: dict[str, object]) -> int:
    """One message per client asked per round (evaluate-in-fit): the sample, or every client."""
    return int(settings.get("clients-per-round", 0)) or num_clients(settings)


def run_floor(workload: str, settings: dict[str, object], threads: int, out: Path) -> PartResult:
    from fedcond.tools.flwr_commands import executable, to_run_config_string

    app = out / "floor-app"
    app.mkdir(parents=True, exist_ok=True)
    clients, rounds = num_clients(settings), int(settings["num-server-rounds"])
    (app / "pyproject.toml").write_text(FLOOR_PYPROJECT)
    (app / "floor_app.py").write_text(FLOOR_APP)
    home = out / "flwr-home"
    environment = flower_home_environment(home, threads)
    marker = f"127.0.0.1:{environment['FLWR_LOCAL_CONTROL_API_PORT']}"
    command = [executable("flwr"), "run", str(app), "--stream",
               "--run-config", to_run_config_string({"num-server-rounds": rounds, "num-supernodes-hint": clients,
                                                     "clients-per-round-hint": messages_per_round(settings)}),
               "--federation-config", f"num-supernodes={clients} client-resources-num-cpus=1"]  # fmt: skip
    try:
        measured = measure(command, environment, home, marker)
    finally:
        stop_superlink(marker)
    timed = [(t, float(m.group(1))) for t, line in measured.lines if (m := FLOOR_SECONDS.search(line))]
    return part_result("floor", workload, clients, measured, [s for _, s in timed], [t for t, _ in timed], None)


# -- environments --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def child_environment(threads: int) -> dict[str, str]:
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH", "")]))
    return environment


def flower_home_environment(home: Path, threads: int) -> dict[str, str]:
    """A Flower home and local SuperLink ports of our own: a SuperLink someone else runs is never used
    (or disturbed), and every measured command starts one cold, as a first ``fedcond run`` does."""
    from fedcond.tools.flwr_commands import flower_environment

    home.mkdir(parents=True, exist_ok=True)
    return flower_environment(
        **child_environment(threads),
        FLWR_HOME=str(home),
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()),
        FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
    )


def stop_superlink(marker: str) -> None:
    """End the local SuperLink this measurement started (found by its own control port), and its children."""
    if not marker:
        return
    for process in detached_roots(marker):
        try:
            members = [*process.children(recursive=True), process]
        except psutil.Error:
            continue
        for member in members:
            with contextlib.suppress(psutil.Error):
                member.terminate()
        psutil.wait_procs(members, timeout=10)


# -- the report -------------------------------------------------------------------------------------------
def num_clients(settings: dict[str, object]) -> int:
    return int(settings["num-clusters"]) * int(settings["clients-per-cluster"])


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def table(results: list[PartResult]) -> str:
    """The issue's table for one workload: every part's numbers, and each against the bare loop."""
    by_part = {result.part: result for result in results}
    bare = by_part.get("bare")
    parts = [part for part in PARTS if part in by_part]
    header = f"{'':34}" + "".join(f"{part:>13}" for part in parts) + (f"{'ratio':>8}" if bare else "")
    lines = [header]

    def row(label: str, value, fmt: str = "{:.1f}", compare: bool = True) -> None:
        cells = "".join(f"{fmt.format(value(by_part[p])):>13}" for p in parts)
        extra = ""
        if bare and compare and "flwr-run" in by_part:
            extra = f"{ratio(value(by_part['flwr-run']), value(bare)):>8}"
        lines.append(f"{label:34}{cells}{extra}")

    row("whole command (s)", lambda r: r.whole_seconds)
    row("per round, rounds 2..n-1 (s)", lambda r: r.steady_round, "{:.2f}")
    row("last round (s)", lambda r: r.round_seconds[-1] if r.round_seconds else float("nan"), "{:.2f}")
    row("round 1 (s)", lambda r: r.round_seconds[0] if r.round_seconds else float("nan"), "{:.2f}")
    row("round 1 - round 2 (s)", lambda r: (r.round_seconds[0] - r.round_seconds[1]) if len(r.round_seconds) > 1
        else float("nan"), "{:.2f}", compare=False)  # fmt: skip
    row("outside the rounds (s)", lambda r: r.whole_seconds - sum(r.round_seconds), compare=False)
    row("  start-up (s)", lambda r: r.startup_seconds, compare=False)
    row("  shut-down (s)", lambda r: r.shutdown_seconds, compare=False)
    row("peak PSS, process tree (GiB)", lambda r: r.peak_pss_bytes / 2**30, "{:.2f}")
    row("peak RSS, process tree (GiB)", lambda r: r.peak_rss_bytes / 2**30, "{:.2f}")
    row("final accuracy", lambda r: r.final_accuracy if r.final_accuracy is not None else float("nan"), "{:.4f}",
        compare=False)  # fmt: skip
    if bare:
        messages = messages_per_round(WORKLOADS[bare.workload])
        for part in parts:
            if part == "bare":
                continue
            if part == "floor":
                per_message = by_part[part].steady_round / messages
                lines.append(f"Flower's floor per message: {1000 * per_message:.1f} ms ({messages} messages a round)")
            else:
                extra = (by_part[part].steady_round - bare.steady_round) / messages
                lines.append(f"{part} overhead per message over the bare loop: {1000 * extra:.1f} ms")
    return "\n".join(lines)


def plot(results: list[PartResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, memory) = plt.subplots(1, 2, figsize=(10, 4))
    for part in PARTS:
        rows = sorted((r for r in results if r.part == part), key=lambda r: r.num_clients)
        if not rows:
            continue
        clients = [r.num_clients for r in rows]
        times.plot(clients, [r.steady_round for r in rows], marker="o", label=part)
        memory.plot(clients, [r.peak_pss_bytes / 2**30 for r in rows], marker="o", label=part)
    for axis, label in ((times, "round time, rounds 2.. (s)"), (memory, "peak PSS of the process tree (GiB)")):
        axis.set_xscale("log")
        axis.set_xlabel("clients")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_results(results: list[PartResult], out: Path) -> None:
    rows = [{**asdict(r), "steady_round": r.steady_round} for r in results]
    (out / "overhead.json").write_text(json.dumps(rows, indent=2))
    with (out / "overhead.csv").open("w", newline="") as handle:  # one flat row per part; the breakdown: JSON
        writer = csv.DictWriter(handle, fieldnames=[key for key in rows[0] if key != "peak_breakdown"])
        writer.writeheader()
        for row in rows:
            row.pop("peak_breakdown")
            writer.writerow({**row, "round_seconds": " ".join(f"{s:.3f}" for s in row["round_seconds"])})
    plot(results, out / "overhead.png")


def benchmark(arguments: argparse.Namespace) -> int:
    out = Path(arguments.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = list(ALL_WORKLOADS) if arguments.workload == "all" else [arguments.workload]
    parts = [part.strip() for part in arguments.parts.split(",")]
    unknown = set(parts) - set(PARTS)
    if unknown:
        print(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    not_fedavg = [name for name in names if WORKLOADS[name].get("method", "fedavg") != "fedavg"]
    if "bare" in parts and not_fedavg:
        print(f"{', '.join(not_fedavg)} runs another method than the bare loop's FedAvg; "
              "give --parts flwr-run,floor", file=sys.stderr)  # fmt: skip
        return 2
    results: list[PartResult] = []
    for name in names:
        settings = {**WORKLOADS[name]}
        if settings.get("client-state-dir") == CLIENT_STATE_HERE:
            settings["client-state-dir"] = str(out / "client-state")
        if arguments.data_dir:
            settings["data-dir"] = str(Path(arguments.data_dir).expanduser().resolve())
        print(f"== {name}: {num_clients(settings)} clients, {settings['num-server-rounds']} rounds, "
              f"{settings['dataset']}, {arguments.threads} threads", flush=True)  # fmt: skip
        workload_results = []
        for part in parts:
            print(f"-- {part} ...", flush=True)
            if part == "bare":
                result = run_bare(name, settings, arguments.threads, out)
            elif part == "floor":
                result = run_floor(name, settings, arguments.threads, out)
            else:
                extra = dict(assignment.split("=", 1) for assignment in arguments.set)
                result = run_framework(name, {**settings, **extra}, arguments.threads, out, part)
            if result.returncode or result.note:
                print(f"   {part} exited {result.returncode} {result.note}", flush=True)
            workload_results.append(result)
            top = ", ".join(f"{process} {pss / 2**20:.0f}" for process, pss in result.peak_breakdown[:8])
            print(f"   {part}: peak PSS by process (MiB): {top}", flush=True)
        print(table(workload_results), flush=True)
        results += workload_results
        write_results(results, out)
    if not arguments.keep:
        shutil.rmtree(out / "flwr-home", ignore_errors=True)
    print(f"results: {out / 'overhead.json'}, {out / 'overhead.csv'}, {out / 'overhead.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bare-loop"]:  # the bare loop's own process
        parser = argparse.ArgumentParser()
        parser.add_argument("command")
        parser.add_argument("--settings", required=True)
        parser.add_argument("--threads", type=int, default=2)
        parser.add_argument("--report", required=True)
        arguments = parser.parse_args(argv)
        report = bare_loop(json.loads(arguments.settings), arguments.threads)
        Path(arguments.report).write_text(json.dumps(report))
        return 0
    if argv[:1] == ["simulate"]:
        return simulate_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        default="clients-10",
        choices=[*WORKLOADS, "all"],
        help="clients-10 (MNIST E1 K=5 x 2, 5 rounds), clients-100, clients-1000, all (those three), quick, "
        "or sparsity-200 (conditional, E1 K=2 x 100, with --parts flwr-run,floor)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the tiny digits smoke workload (same as --workload quick)"
    )
    parser.add_argument("--parts", default="bare,flwr-run,floor", help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the bare loop (and OMP threads)")
    parser.add_argument("--data-dir", default="", help="folder with the MNIST idx files (or FEDCOND_DATA_DIR)")
    parser.add_argument("--out", default="", help="results folder (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the benchmark's Flower home (SuperLink logs)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a run-config setting for the framework's parts (repeatable), e.g. live-curves=false",
    )  # fmt: skip
    arguments = parser.parse_args(argv)
    if bad := [assignment for assignment in arguments.set if "=" not in assignment]:
        parser.error(f"--set {bad[0]}: give KEY=VALUE, e.g. --set live-curves=false")
    if arguments.quick:
        arguments.workload = "quick"
    if not arguments.out:
        arguments.out = tempfile.mkdtemp(prefix="fedcond-overhead-")
    return benchmark(arguments)


if __name__ == "__main__":
    raise SystemExit(main())
