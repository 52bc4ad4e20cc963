"""Accuracy against privacy: short federated runs under each DP setting, and what noise the DP
fingerprint needs on a dataset.

    python benchmarks/privacy_accuracy.py --out results/privacy            # digits default, 10 rounds
    python benchmarks/privacy_accuracy.py --out DIR --engine flower --only fedavg,fedavg-dp1
    python benchmarks/privacy_accuracy.py --out DIR --rounds 5 dataset=mnist data-dir=DIR data-fraction=0.1
    python benchmarks/privacy_accuracy.py --fingerprint-noise dataset=mnist data-dir=DIR

Runs every setting below (or ``--only``) one after another and prints one table row per run: final
and best accuracy, the final sample-level epsilon (the worst-off client's), the client-level
epsilon, and the median seconds of a round after the first (``loop``: CPU seconds of the process,
threads pinned with ``--threads``; ``flower``: wall seconds). Other run-config settings go after the
options as key=value. DP noise differs every run: repeat with another ``--out`` to see the spread.

Two engines:
- ``loop`` (default): the federation in this process, with fedcond's own client functions
  (``train`` / ``train_private``, the DP fingerprint, FedAvg's averaging, evaluation) and Flower's
  own client-level DP functions (the clipping and noise its wrappers apply): no Ray, so it measures
  what DP costs the clients on a busy machine, and each run's ``OUT/<name>.json`` keeps its rounds.
- ``flower``: each run as an in-process Flower simulation (``fedcond compare``'s path), into
  ``OUT/<name>/`` with its history.csv and run.json (round 1 also pays for Ray's start).

``--calibrate`` trains nothing: for each ``--epsilons`` target it finds the noise multipliers that
reach it after ``--rounds`` rounds on the scenario (the worst-off client's epsilon, as the history
records it): client level (``client-dp-noise-multiplier``), DP-SGD alone (fedavg, oracle) and DP-SGD
with a DP fingerprint of half the target (conditional); experiments/grids/privacy-mnist-e1-k5.toml
holds its numbers for MNIST E1 K=5 at a quarter of the data.

``--fingerprint-noise`` trains nothing: per client of the scenario it computes the exact fingerprint
and, for each ``--epsilons`` value, the DP one, and prints the sensitivity bound, the noise std, how
far apart the clients' exact fingerprints are (the signal) and the mean cosine between each
client's DP and exact z-scored fingerprint (1: the noise changes nothing the model sees).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from fedcond.config import RunConfig
from fedcond.data.client_data import client_fingerprint, load_client_data
from fedcond.federation import client_dp
from fedcond.federation.checks import check_run
from fedcond.federation.methods import run_config
from fedcond.fingerprint import fingerprints as fp
from fedcond.privacy.attack import cosine_similarity
from fedcond.records.history import error_line, mark_failed, run_status
from fedcond.tools.flwr_commands import parse_assignments
from fedcond.tools.simulation import simulate

# name -> run-config settings on top of the command line's.
SETTINGS: dict[str, dict[str, object]] = {
    "fedavg": {"method": "fedavg"},
    "fedavg-dp0.2": {"method": "fedavg", "dp-noise-multiplier": 0.2},
    "fedavg-dp0.5": {"method": "fedavg", "dp-noise-multiplier": 0.5},
    "fedavg-dp1": {"method": "fedavg", "dp-noise-multiplier": 1.0},
    "conditional": {"method": "conditional"},
    "conditional-fp8": {"method": "conditional", "fingerprint-epsilon": 8.0},
    "conditional-dp0.5-fp8": {"method": "conditional", "dp-noise-multiplier": 0.5, "fingerprint-epsilon": 8.0},
    "conditional-dp1-fp8": {"method": "conditional", "dp-noise-multiplier": 1.0, "fingerprint-epsilon": 8.0},
    "fedavg-client-dp0.1": {"method": "fedavg", "client-dp": "server-side", "client-dp-noise-multiplier": 0.1},
    "fedavg-client-dp1": {"method": "fedavg", "client-dp": "server-side", "client-dp-noise-multiplier": 1.0},
    "conditional-client-dp0.1": {
        "method": "conditional", "client-dp": "client-side", "client-dp-noise-multiplier": 0.1,
        # The digits clients' (f, f^2) have norms of 2.2-3.3: the statistics' sum is noised for 4.
        "client-dp-statistics-clipping-norm": 4.0,
    },
}  # fmt: skip


def summarise(folder: Path) -> dict[str, object]:
    """One table row from a run's folder."""
    info = json.loads((folder / "run.json").read_text())
    history = folder / "history.csv"
    rows = list(csv.DictReader(history.read_text().splitlines())) if history.exists() else []
    accuracies = [float(row["accuracy"]) for row in rows]
    client_level = (info.get("privacy") or {}).get("client_level") or {}
    by_round = client_level.get("epsilon_by_round") or []
    return {
        "status": run_status(folder),
        "final": accuracies[-1] if accuracies else math.nan,
        "best": max(accuracies, default=math.nan),
        "epsilon": float(rows[-1]["epsilon"]) if rows else math.nan,
        "client_epsilon": by_round[-1] if by_round else None,
        # Round 1 also pays for Ray's actors starting and importing torch: the median of the others.
        "seconds": float(np.median([float(row["seconds"]) for row in rows[1:]])) if len(rows) > 1 else math.nan,
    }


def run_in_process(config: RunConfig, method_conditioned: bool) -> dict[str, object]:
    """One run of ``config`` as the federation would compute it, in this process: every training
    client trains the global model (DP-SGD under ``dp-noise-multiplier``), FedAvg averages (under
    ``client-dp``: uniformly, each update clipped and the average noised by Flower's own functions),
    every client evaluates the new model on its test set."""
    from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_clip_model_update, compute_stdv

    from fedcond.federation.client_dp import CLIENT_DP_CLIPPING_NORM, CLIENT_DP_NOISE_MULTIPLIER, client_dp_mode
    from fedcond.model.aggregation import weighted_average
    from fedcond.model.networks import build_run_model, get_weights, set_weights
    from fedcond.model.training import DpSgd, TrainSettings, evaluate, train, train_private
    from fedcond.privacy.dp import PrivacyLedger, SampleLevelPrivacy, private_fingerprint
    from fedcond.records.metrics import ClientEvaluation, summarise_evaluations

    config = config.resolved()
    clients = [load_client_data(config, partition) for partition in range(config.num_training_clients)]
    privacy = SampleLevelPrivacy.of(config)
    ledgers = [PrivacyLedger() for _ in clients]
    conditions: list[np.ndarray | None] = [None] * len(clients)
    if method_conditioned:
        raws = []
        for data, ledger in zip(clients, ledgers, strict=True):
            raw = client_fingerprint(config, data)
            if privacy.private_fingerprint:
                release = private_fingerprint(
                    raw, config.fingerprint, data.train_x, data.train_y, data.num_classes, config.fingerprint_dim,
                    privacy,
                )  # fmt: skip
                raw = release.vector
                ledger.add(release.noise_multiplier, 1.0, 1)
            raws.append(raw)
        mean, std = fp.mean_and_std(np.sum(raws, axis=0), np.sum(np.square(raws), axis=0), len(raws))
        conditions = [fp.normalise(raw, config.normalisation, mean, std) for raw in raws]
    model = build_run_model(config, clients[0].num_classes, method_conditioned)
    current = get_weights(model)
    settings = TrainSettings.of(config)
    mode = client_dp_mode(config)
    clip, noise = CLIENT_DP_CLIPPING_NORM.of(config), CLIENT_DP_NOISE_MULTIPLIER.of(config)
    rounds = []
    for server_round in range(1, config.num_server_rounds + 1):
        start, cpu_start = time.perf_counter(), time.process_time()
        returned = []
        for data, condition, ledger in zip(clients, conditions, ledgers, strict=True):
            set_weights(model, current)
            if privacy.dp_sgd:
                dp_sgd = DpSgd(privacy.noise_multiplier, privacy.max_grad_norm)
                train_private(model, data.train_x, data.train_y, condition, settings, dp_sgd, ledger)
            else:
                seed = int(np.random.SeedSequence([config.seed, server_round, data.partition_id]).generate_state(1)[0])
                train(model, data.train_x, data.train_y, condition, settings, seed)
            update = get_weights(model)
            if mode != "off":
                compute_clip_model_update(update, current, clip)
            returned.append(update)
        if mode == "off":
            current = weighted_average(returned, [len(data.train_y) for data in clients])
        else:
            current = weighted_average(returned, [1.0] * len(returned))
            add_gaussian_noise_inplace(current, compute_stdv(noise, clip, len(returned)))
        set_weights(model, current)
        evaluations = []
        for data, condition in zip(clients, conditions, strict=True):
            result = evaluate(model, data.test_x, data.test_y, condition)
            evaluations.append(ClientEvaluation(data.cluster, result.num_samples, result.loss, result.accuracy))
        accuracy = summarise_evaluations(evaluations)[0]
        # As the clients report it: inf when only the fingerprint is DP (the updates are not).
        epsilon = max(ledger.epsilon(privacy.delta) for ledger in ledgers) if privacy.dp_sgd else math.nan
        epsilon = math.inf if privacy.enabled and not privacy.dp_sgd else epsilon
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        rounds.append({"round": server_round, "accuracy": accuracy, "epsilon": epsilon, "seconds": seconds,
                       "cpu_seconds": cpu_seconds})  # fmt: skip
        print(f"  {config.method} round {server_round}: accuracy {accuracy:.4f} epsilon {epsilon:.3g} "
              f"{seconds:.1f} s ({cpu_seconds:.1f} s CPU)", file=sys.stderr, flush=True)  # fmt: skip
    client_level = client_dp.describe(config)
    return {"rounds": rounds, "client_epsilon": (client_level or {}).get("epsilon_by_round", [None])[-1]}


def summarise_loop(report: Path) -> dict[str, object]:
    """One table row from an in-process run's report."""
    result = json.loads(report.read_text())
    rounds = result["rounds"]
    accuracies = [entry["accuracy"] for entry in rounds]
    return {
        "status": "finished",
        "final": accuracies[-1],
        "best": max(accuracies),
        "epsilon": rounds[-1]["epsilon"] if rounds[-1]["epsilon"] is not None else math.nan,
        "client_epsilon": result["client_epsilon"],
        # CPU seconds of this process: on a machine shared with other work, wall time says more about
        # the other work than about DP.
        "seconds": float(np.median([entry["cpu_seconds"] for entry in rounds[1:]])) if len(rounds) > 1 else math.nan,
    }


def run_all(names: list[str], out: Path, rounds: int, extra: dict[str, object], attempts: int, engine: str) -> None:
    """Run (or, when already finished in ``out``, reuse) every setting; a failed run is tried again."""
    print(
        "| setting | status | final accuracy | best accuracy | epsilon (sample) | epsilon (client) "
        "| s/round (median of rounds 2+) |"
    )
    print("|---|---|---|---|---|---|---|", flush=True)
    for name in names:
        folder = out / name
        config = run_config({
            "num-server-rounds": rounds, **extra, **SETTINGS[name], "results-dir": str(out), "run-name": name,
            "verbose": False,
        })  # fmt: skip
        method = check_run(config)
        if engine == "loop":
            report = out / f"{name}.json"
            if not report.exists():
                out.mkdir(parents=True, exist_ok=True)
                report.write_text(json.dumps(run_in_process(config, method.conditioned)) + "\n")
            print_row(name, summarise_loop(report))
            continue
        for _ in range(attempts):
            if run_status(folder) == "finished":
                break
            shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt's folder: start it afresh
            try:
                simulate(config, quiet=True)
            except Exception as error:  # e.g. Ray failing to start on a busy machine: the run says so
                mark_failed(folder, error_line(error))
        print_row(name, summarise(folder))


def print_row(name: str, row: dict[str, object]) -> None:
    client = "-" if row["client_epsilon"] is None else f"{row['client_epsilon']:.3g}"
    print(
        f"| {name} | {row['status']} | {row['final']:.4f} | {row['best']:.4f} | {row['epsilon']:.3g} | {client} "
        f"| {row['seconds']:.2f} |",
        flush=True,
    )


def fingerprint_noise(extra: dict[str, object], epsilons: list[float]) -> None:
    from fedcond.privacy.dp import SampleLevelPrivacy, private_fingerprint

    config = run_config(extra).resolved()
    clients = [load_client_data(config, partition) for partition in range(config.num_training_clients)]
    raws = np.array([client_fingerprint(config, data) for data in clients])
    mean, std = raws.mean(axis=0), raws.std(axis=0)
    exact = [fp.standardise(raw, mean, std) for raw in raws]
    counts = [len(data.train_y) for data in clients]
    print(f"{config.dataset} {config.scenario}: {len(clients)} clients, {min(counts)}-{max(counts)} training samples, "
          f"fingerprint {config.fingerprint} (l={config.fingerprint_dim}); between-client std of the exact "
          f"fingerprint: mean {std.mean():.3g}, largest {std.max():.3g}; largest entry {raws.max():.3g}")  # fmt: skip
    print("| fingerprint-epsilon | sensitivity (median client) | noise std (median client) | cos(DP z, exact z) |")
    print("|---|---|---|---|")
    for epsilon in epsilons:
        privacy = SampleLevelPrivacy(0.0, 1.0, 1e-5, epsilon)
        releases = [
            private_fingerprint(
                raw, config.fingerprint, data.train_x, data.train_y, data.num_classes, config.fingerprint_dim, privacy
            )
            for raw, data in zip(raws, clients, strict=True)
        ]
        noisy = np.array([release.vector for release in releases])
        noisy_z = [fp.standardise(vector, noisy.mean(axis=0), noisy.std(axis=0)) for vector in noisy]
        cosine = np.mean([cosine_similarity(a, b) for a, b in zip(noisy_z, exact, strict=True)])
        sensitivity = float(np.median([release.sensitivity for release in releases]))
        noise = float(np.median([release.noise_std for release in releases]))
        print(f"| {epsilon:g} | {sensitivity:.3g} | {noise:.3g} | {cosine:.3f} |", flush=True)


def noise_for(epsilon_of: Callable[[float], float], target: float) -> float:
    """The noise multiplier at which ``epsilon_of`` (decreasing in it) reaches ``target``, to 0.1 %."""
    low, high = 0.05, 200.0
    while high - low > 1e-3 * low:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if epsilon_of(middle) > target else (low, middle)
    return high


def calibrate(extra: dict[str, object], epsilons: list[float], rounds: int) -> None:
    from fedcond.data.scenarios import scenario_for
    from fedcond.privacy.dp import PrivacyLedger, gaussian_noise_multiplier, gaussian_rounds_epsilon

    config = run_config({**extra, "num-server-rounds": rounds}).resolved()
    counts = [len(client.train_indices) for client in scenario_for(config).clients if not client.held_out]
    delta, batch, epochs = 1e-5, config.batch_size, config.local_epochs

    def worst(noise: float, fingerprint_noise: float = 0.0) -> float:
        epsilons_of_clients = []
        for count in set(counts):
            ledger = PrivacyLedger()
            if fingerprint_noise:
                ledger.add(fingerprint_noise, 1.0, 1)
            batches = math.ceil(count / batch)  # Opacus: sampling rate 1 / batches, batches steps an epoch
            ledger.add(noise, 1.0 / batches, batches * epochs * rounds)
            epsilons_of_clients.append(ledger.epsilon(delta))
        return max(epsilons_of_clients)

    print(f"{config.dataset} {config.scenario}, {len(counts)} clients of {min(counts)}-{max(counts)} training "
          f"samples, batch {batch}, {epochs} local epoch(s), {rounds} rounds, delta {delta:g}")  # fmt: skip
    print("| target epsilon | client-dp-noise-multiplier | the same, conditional (+ its statistics' release) | "
          "dp-noise-multiplier (DP-SGD alone) | fingerprint-epsilon, dp-noise-multiplier (conditional) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for target in epsilons:
        client_level = noise_for(lambda z: gaussian_rounds_epsilon(z, rounds, delta), target)
        # normalisation=federated: one more release of the same multiplier (fedcond/federation/client_dp.py).
        with_statistics = noise_for(lambda z: gaussian_rounds_epsilon(z, rounds, delta, releases=1), target)
        alone = noise_for(worst, target)
        fingerprint_noise = gaussian_noise_multiplier(target / 2, delta)
        with_fingerprint = noise_for(lambda z, f=fingerprint_noise: worst(z, f), target)
        print(f"| {target:g} | {client_level:.3f} | {with_statistics:.3f} | {alone:.3f} | "
              f"{target / 2:g}, {with_fingerprint:.3f} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for the runs (required unless --fingerprint-noise)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--engine", choices=("loop", "flower"), default="loop")
    parser.add_argument("--threads", type=int, default=1, help="loop: torch threads")
    parser.add_argument("--attempts", type=int, default=2, help="tries per run (Ray can fail to start when busy)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(SETTINGS)}")
    parser.add_argument("--fingerprint-noise", action="store_true")
    parser.add_argument("--calibrate", action="store_true", help="the noise multipliers for --epsilons targets")
    parser.add_argument("--epsilons", default="1,8,64", help="--fingerprint-noise, --calibrate: the epsilons")
    parser.add_argument("assignments", nargs="*", help="other run-config settings, key=value")
    args = parser.parse_args()
    extra = parse_assignments(args.assignments)
    if args.fingerprint_noise:
        fingerprint_noise(extra, [float(value) for value in args.epsilons.split(",")])
        return
    if args.calibrate:
        calibrate(extra, [float(value) for value in args.epsilons.split(",")], args.rounds)
        return
    if args.out is None:
        parser.error("--out is required")
    torch.set_num_threads(args.threads)
    names = args.only.split(",") if args.only else list(SETTINGS)
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    run_all(names, args.out.resolve(), args.rounds, extra, args.attempts, args.engine)


if __name__ == "__main__":
    main()
