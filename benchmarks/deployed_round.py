"""What a deployed round costs: fedcond's app against Flower's floor, on the same SuperLink and SuperNodes.

    python benchmarks/deployed_round.py                        # 3 nodes, 3 rounds, once (~6-10 min)
    python benchmarks/deployed_round.py --nodes 3 --rounds 4 --repeats 2 --profile

Runs, on one machine, what ``fedcond deploy-local`` runs (a TLS SuperLink admitting only registered
SuperNodes, one SuperNode per client on 127.0.0.1, digits, ``conditional``, one client per cluster):

1. **cold messages**: each in a fresh process, as ``flwr-clientapp`` handles one message, one after
   the other (no contention): Python and Flower's ClientApp runtime, unpacking the app's FAB, importing
   the app, then a fit message and a second one in the same process (what persists across messages
   in one process), and an evaluate message in another fresh process. For fedcond's app and for
   Flower's floor (a minimal app: a one-number model, no torch, from ``benchmarks/overhead.py``).
2. **deployed rounds**: the floor app and fedcond's app, ``--repeats`` times each, alternately, through
   ``flwr run`` to the same SuperLink and SuperNodes; per-round seconds (the floor's own timer from
   ``configure_fit`` to the end of ``aggregate_evaluate``; fedcond's ``history.csv`` ``seconds``,
   the same span). Round 1 also holds one-off work (fedcond's secure-sum set-up, the first fetch of
   each FAB), and the last the closing evaluate messages: compare rounds 2 to n-1.
3. with ``--profile``: the SuperNodes log at DEBUG (timestamps), and each message is split into
   Flower's phases from their logs: waiting for the SuperNode's poll, SuperExec poll and process
   start with Flower's imports, FAB install, the app (import and work), and the reply.

It prints the load average before and after: on a busy machine every number is pessimistic.
docs/deployment.md ("Fast deployed rounds") says what was measured and what each phase means.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from overhead import FLOOR_APP, FLOOR_PYPROJECT, steady_rounds  # noqa: E402

from fedcond.config import RunConfig  # noqa: E402
from fedcond.data.client_data import export_partitions  # noqa: E402
from fedcond.tools.deploy import LocalDeployment, sigterm_as_interrupt  # noqa: E402
from fedcond.tools.flwr_commands import app_directory, prepare  # noqa: E402
from fedcond.tools.processes import tagged  # noqa: E402

FLOOR_ROUND = re.compile(r"round +(\d+)/x seconds ([0-9.]+)")
RUN_TIMEOUT = 1800.0  # seconds one run may take on a very busy machine

# One cold message in a fresh process. argv: app ("fedcond" or "floor"), FAB file, install folder,
# message type ("train" or "evaluate"), partition file, number of partitions. Prints one line per
# stage: "stage WALL_SECONDS CPU_SECONDS NAME" (CPU: this process's user + system time).
COLD_MESSAGE = r"""
import sys, time
stages, mark = [], (time.perf_counter(), time.process_time())
def stage(name):
    global mark
    now = (time.perf_counter(), time.process_time())
    stages.append((name, now[0] - mark[0], now[1] - mark[1]))
    mark = now
import flwr.supernode.cli.flwr_clientapp  # what `flwr-clientapp` imports before it asks for its task
import flwr.supernode.runtime.run_clientapp
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.cli.install import install_from_fab
from flwr.common import EvaluateIns, FitIns, ndarrays_to_parameters
from flwr.compat.common.recorddict_compat import evaluateins_to_recorddict, fitins_to_recorddict
from flwr.supercore.task_identity import TaskIdentity
from pathlib import Path
stage("Flower's ClientApp runtime imported")
app_name, fab, install_dir, message_type, partition_file, partitions = sys.argv[1:7]
installed = install_from_fab(Path(fab).read_bytes(), Path(install_dir), skip_prompt=True)
stage("FAB unpacked, checked, installed")
sys.path.insert(0, str(installed))
if app_name.startswith("fedcond"):
    from fedcond.federation.client_app import make_client_app
    from fedcond.config import RunConfig
    config = RunConfig(num_clusters=int(partitions), clients_per_cluster=1, normalisation="none")
    app = make_client_app(config)
else:
    from floor_app import client as app
stage("the app imported")
import numpy as np
if app_name.startswith("fedcond"):
    from fedcond.model.networks import build_run_model, get_weights
    weights = get_weights(build_run_model(config.resolved(), 10, True))  # the server's part: not a stage
else:
    weights = [np.zeros(1)]
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
context = Context(1, 1, {"partition-id": 0, "num-partitions": int(partitions), "partition-file": partition_file},
                  RecordDict(), {})
parameters = ndarrays_to_parameters(weights)
if message_type == "train":
    content, kind = fitins_to_recorddict(FitIns(parameters, {"server-round": 1}), keep_input=True), MessageType.TRAIN
else:
    content, kind = evaluateins_to_recorddict(EvaluateIns(parameters, {"server-round": 1}), True), MessageType.EVALUATE
mark = (time.perf_counter(), time.process_time())
for label in ("first", "second"):
    app(Message(content, dst_node_id=1, message_type=kind), context)
    stage(f"{label} {message_type} message handled")
for name, wall, cpu in stages:
    print(f"stage {wall:.4f} {cpu:.4f} {name}")
"""


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} (1, 5, 15 min) on {os.cpu_count()} cores"


def write_floor_app(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(FLOOR_PYPROJECT)
    (folder / "floor_app.py").write_text(FLOOR_APP)
    return folder


def build_fab(app: Path, out: Path) -> Path:
    from flwr.cli.build import build_fab_from_disk

    out.write_bytes(build_fab_from_disk(app))
    return out


def cold_messages(apps: dict[str, Path], workdir: Path, partition_file: Path, partitions: int, repeats: int) -> None:
    """Per app and message type, the median of ``repeats`` fresh processes, stage by stage: wall and CPU seconds."""
    print(f"\n== cold messages: one fresh process per message, one at a time, 1 torch thread (median of {repeats})")
    print("   CPU seconds are the process's own (user + system): what a busy machine distorts least.")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_LOG_LEVEL": "WARNING", "PYTHONPATH": ""}
    for name, app in apps.items():
        fab = build_fab(app, workdir / f"{name.split()[0]}-{len(name)}.fab")
        print(f"-- {name} (FAB {fab.stat().st_size / 1024:.0f} KiB)      wall s    CPU s")
        for message_type in ("train", "evaluate"):
            runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for repeat in range(repeats):
                install_dir = workdir / f"install-{len(name)}-{name.split()[0]}-{message_type}-{repeat}"
                command = [sys.executable, "-c", COLD_MESSAGE, name, str(fab), str(install_dir), message_type,
                           str(partition_file), str(partitions)]  # fmt: skip
                children = resource.getrusage(resource.RUSAGE_CHILDREN)
                started = time.perf_counter()
                result = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=workdir)
                wall = time.perf_counter() - started
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
                if result.returncode != 0:
                    raise SystemExit(f"cold {name} {message_type} message failed:\n{result.stderr[-3000:]}")
                # Flower's installer prints too: keep the stage lines.
                stages = [line.split(" ", 3)[1:] for line in result.stdout.splitlines() if line.startswith("stage ")]
                inside = (sum(float(w) for w, _, _ in stages), sum(float(c) for _, c, _ in stages))
                runs["Python start and exit (outside the stages)"].append((wall - inside[0], cpu - inside[1]))
                for stage_wall, stage_cpu, label in stages:
                    runs[label].append((float(stage_wall), float(stage_cpu)))
                runs["whole process"].append((wall, cpu))
            for label, values in runs.items():
                wall_median = statistics.median(w for w, _ in values)
                cpu_median = statistics.median(c for _, c in values)
                print(f"   {message_type:8s} {label:42s} {wall_median:7.2f} {cpu_median:8.2f}")


def floor_round_seconds(log: Path) -> list[float]:
    return [float(match.group(2)) for line in log.read_text().splitlines() if (match := FLOOR_ROUND.search(line))]


def fedcond_round_seconds(results: Path) -> list[float]:
    (run,) = [folder for folder in results.iterdir() if (folder / "history.csv").is_file()]
    with (run / "history.csv").open() as handle:
        return [float(row["seconds"]) for row in csv.DictReader(handle)]


class CpuMeter:
    """CPU seconds (user + system) of every process the deployment started, sampled every 0.5 s: a
    process's last sample counts, so a ClientApp process loses at most its final half second."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.seen: dict[tuple[int, float], float] = {}  # (pid, start time) to its latest CPU seconds

    def sample(self) -> float:
        for pid in tagged(self.tag):
            try:
                process = psutil.Process(pid)
                times = process.cpu_times()
                self.seen[(pid, process.create_time())] = times.user + times.system
            except psutil.Error:
                continue
        return sum(self.seen.values())


def submit_and_wait(
    deployment: LocalDeployment, app: Path, run_config: dict[str, object], name: str
) -> tuple[float, float]:
    """Run ``app`` to its end; its wall seconds and the CPU seconds all deployment processes spent meanwhile."""
    meter = CpuMeter(deployment.processes.tag)
    before = meter.sample()
    started = time.monotonic()
    process = deployment.submit(app, run_config, log_as=name)
    reported: set[str] = set()
    while process.poll() is None:
        deployment.check_running(reported)
        if time.monotonic() - started > RUN_TIMEOUT:
            raise SystemExit(f"{name} took over {RUN_TIMEOUT:.0f} s; see {deployment.processes.log_path(name)}")
        meter.sample()
        time.sleep(0.5)
    return time.monotonic() - started, meter.sample() - before


# -- the phases of each message, from the SuperNodes' DEBUG logs ------------------------------------------------
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
EVENTS = {
    "Receiving:": "received",
    "Start `flwr-clientapp` process": "runtime up",
    "Start FAB installation": "fab start",
    "Loading ClientApp": "app loading",
    "Runtime.PushMessages": "reply pushed",
    "Sent successfully": "sent",
}
PHASES = (
    ("received", "runtime up", "SuperExec poll + new process + Flower's imports"),
    ("runtime up", "fab start", "task, message and FAB pulled from the SuperNode"),
    ("fab start", "app loading", "FAB unpacked, checked, installed"),
    ("app loading", "reply pushed", "the app: import, data, work"),
    ("reply pushed", "sent", "reply sent to the SuperLink"),
)


def message_phases(log: Path) -> list[dict[str, float]]:
    """Each message of one SuperNode log: event name to timestamp (seconds)."""
    messages: list[dict[str, float]] = []
    current: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        stamp = STAMP.search(line)
        event = next((name for marker, name in EVENTS.items() if marker in line), None)
        if stamp is None or event is None:
            continue
        seconds = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if event == "received":
            current = {"received": seconds, "kind": 0.0 if "train" in line else 1.0}
            messages.append(current)
        elif event not in current:
            current[event] = seconds
    return [message for message in messages if all(event in message for event in EVENTS.values())]


def print_phases(label: str, logs: list[Path], since: float, until: float) -> None:
    phases: dict[str, list[float]] = defaultdict(list)
    gaps: list[float] = []
    for log in logs:
        messages = [m for m in message_phases(log) if since <= m["received"] <= until]
        for message in messages:
            for start, end, name in PHASES:
                phases[name].append(message[end] - message[start])
            phases["whole message at the node"].append(message["sent"] - message["received"])
        gaps += [later["received"] - earlier["sent"] for earlier, later in itertools.pairwise(messages)]
    if not phases:
        print(f"   {label}: no complete messages in the logs")
        return
    print(f"-- {label}: {len(phases['whole message at the node'])} messages, mean seconds per message")
    for name, values in phases.items():
        print(f"   {statistics.mean(values):7.2f} s  {name}")
    if gaps:
        print(f"   {statistics.mean(gaps):7.2f} s  between a reply sent and the node's next message received "
              "(other nodes, the server's 3 s pull, aggregation, the node's 3 s poll)")  # fmt: skip


def deployed_rounds(
    deployment: LocalDeployment, floor: Path, config: RunConfig, args: argparse.Namespace, workdir: Path
) -> None:
    """Part 2 (and 3 with --profile): both apps through `flwr run` on the same SuperLink and SuperNodes."""
    deployment.start(config, args.nodes)
    os.environ.pop("FLWR_LOG_LEVEL", None)
    print(f"\n== deployed rounds: {args.nodes} SuperNodes, {args.rounds} rounds, TLS, authenticated nodes")
    seconds: dict[str, list[list[float]]] = defaultdict(list)
    windows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for repeat in range(args.repeats):
        for name in ("floor", "fedcond"):
            begin = time.time()
            if name == "floor":
                run_config = {"num-server-rounds": args.rounds, "num-supernodes-hint": args.nodes}
                wall, cpu = submit_and_wait(deployment, floor, run_config, f"floor-{repeat}")
                rounds = floor_round_seconds(deployment.processes.log_path(f"floor-{repeat}"))
            else:
                results = workdir / f"results-{repeat}"
                settings = [f"num-clusters={args.nodes}", "clients-per-cluster=1", "verbose=false",
                            f"num-server-rounds={args.rounds}", f"results-dir={results}"]  # fmt: skip
                _, overrides = prepare(settings)
                wall, cpu = submit_and_wait(deployment, app_directory(), overrides, f"fedcond-{repeat}")
                rounds = fedcond_round_seconds(results)
            if len(rounds) != args.rounds:
                folder = deployment.processes.log_folder
                raise SystemExit(f"{name} run {repeat}: {len(rounds)} of {args.rounds} rounds; see {folder}")
            seconds[name].append(rounds)
            windows[name].append((begin, time.time()))
            print(f"   {name:8s} run {repeat}: rounds " + ", ".join(f"{s:.1f}" for s in rounds)
                  + f" s; whole flwr run {wall:.1f} s, {cpu:.1f} CPU s in the deployment's processes; {load()}",
                  flush=True)  # fmt: skip
    later = {name: [s for run in runs for s in steady_rounds(run)] for name, runs in seconds.items()}
    if all(later.values()):
        floor_mean, fedcond_mean = statistics.mean(later["floor"]), statistics.mean(later["fedcond"])
        print(f"   rounds 2..n-1: floor {floor_mean:.1f} s, fedcond {fedcond_mean:.1f} s per round; "
              f"ratio {fedcond_mean / floor_mean:.2f}")  # fmt: skip
    if args.profile:
        print("\n== message phases at the SuperNodes (DEBUG timestamps)")
        logs = [deployment.processes.log_path(f"supernode-{i}") for i in range(args.nodes)]
        for name, spans in windows.items():
            for begin, end in spans:
                print_phases(name, logs, begin, end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each app, alternating")
    parser.add_argument("--cold-repeats", type=int, default=3, help="fresh processes per cold message (0: skip)")
    parser.add_argument("--no-rounds", action="store_true", help="the cold messages alone (CPU seconds, quick)")
    parser.add_argument("--profile", action="store_true", help="DEBUG logs on the nodes, message phases printed")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs) afterwards")
    parser.add_argument("--compare-app", metavar="DIR", type=Path,
                        help="also measure the cold messages of another fedcond app folder, e.g. an older commit's "
                             "`git archive` export (its FAB as its pyproject.toml builds it)")  # fmt: skip
    args = parser.parse_args()
    print(f"before: {load()}")
    workdir = Path(tempfile.mkdtemp(prefix="fedcond-deployed-round-"))
    floor = write_floor_app(workdir / "floor-app")
    config = RunConfig(num_clusters=args.nodes, clients_per_cluster=1)
    if args.profile:
        os.environ["FLWR_LOG_LEVEL"] = "DEBUG"  # the deployment's processes inherit it
    # Ctrl+C and SIGTERM (also when started in the background) stop every process the deployment started.
    with sigterm_as_interrupt(), LocalDeployment(workdir / "deployment") as deployment:
        if args.cold_repeats:
            partition_file = export_partitions(config, workdir / "partitions")[0]
            apps = {"floor": floor, "fedcond": app_directory()}
            if args.compare_app is not None:
                apps["fedcond (--compare-app)"] = args.compare_app.resolve()
            cold_messages(apps, workdir, partition_file, args.nodes, args.cold_repeats)
        if not args.no_rounds:
            deployed_rounds(deployment, floor, config, args, workdir)
    print(f"\nafter: {load()}")
    if args.keep:
        print(f"work folder kept: {workdir}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.stdout = io.TextIOWrapper(sys.stdout.buffer, line_buffering=True)
    main()
