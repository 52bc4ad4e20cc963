"""Every method on CUDA: does each one pick the GPU by itself, train there, and give the CPU's numbers?

    python benchmarks/cuda_methods.py --smoke [--rounds 3]                 # every method, digits, CUDA and CPU
    python benchmarks/cuda_methods.py --rerun RUN_FOLDER [RUN_FOLDER ...]  # a committed run again, here

``--smoke`` runs every registered method (the paper's eight, the competitors, the pooled references,
the ``recommended`` variant) and two cross-cutting paths (sample-level DP-SGD through Opacus, and a
held-out newcomer) on digits E1 K=2 with 3 clients per cluster, once with the device fedcond picks
(``fedcond.model.device.pick_device``) and once in a child process that sees no GPU
(``CUDA_VISIBLE_DEVICES=""``): final accuracy on each, seconds, and the GPU memory each run
allocated (0 would mean it never trained there). ``--rerun`` reads a committed run's ``run.json``,
runs the same configuration on this machine and sets its final accuracy and seconds beside the
committed ``history.csv``'s.

Both run the federated methods in this process, one client at a time, through
``fedcond/tools/in_process.py`` (the ServerApp's round loop and the real ClientApp clients, no Ray or
SuperLink): a GPU machine needs torch, numpy, scikit-learn, flwr (without Ray) and Opacus, and
Ray's start never enters the timings. Without it, no SecAgg+ (see that module). Results go to
``--out`` as ``cuda_methods.md`` and a folder per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from fedcond.federation.methods import get_method, registry, run_config
from fedcond.model.device import pick_device
from fedcond.pooled import run_pooled
from fedcond.records.history import dataset_metric
from fedcond.tools.experiment import read_history
from fedcond.tools.in_process import run_in_process

# Normalisation "none": the federated z-score needs SecAgg+'s grid, which an in-process run lacks.
SMOKE = {"dataset": "digits", "num-clusters": 2, "clients-per-cluster": 3, "normalisation": "none", "verbose": False}
#: Paths no method name covers: (label, method, extra settings).
EXTRA = (
    ("conditional + DP-SGD", "conditional", {"dp-noise-multiplier": 1.0}),
    ("conditional + newcomer", "conditional", {"held-out-clients": 1}),
)


def final_row(folder: Path, dataset: str) -> dict[str, str]:
    """The run's last round, its score under ``accuracy`` (a regression task's rmse included)."""
    return read_history(folder / "history.csv", dataset_metric(dataset))[-1]


def run_once(settings: dict, out: Path, name: str) -> dict:
    """One run of ``settings`` into ``out/name``: final accuracy, seconds, GPU memory allocated."""
    config = run_config({**settings, "results-dir": str(out), "run-name": name})
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if get_method(config.method).protocol == "pooled":
        recorder = run_pooled(config)
    else:
        recorder, _ = run_in_process(config)
    seconds = time.perf_counter() - start
    row = final_row(Path(recorder.folder), config.dataset)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {"accuracy": float(row["accuracy"]), "seconds": seconds, "gpu_mib": peak / 2**20}


def smoke_cases(rounds: int) -> list[tuple[str, dict]]:
    cases = [(name, {**SMOKE, "method": name, "num-server-rounds": rounds}) for name in registry()]
    cases += [
        (label, {**SMOKE, "method": method, "num-server-rounds": rounds, **extra}) for label, method, extra in EXTRA
    ]
    return cases


def smoke(rounds: int, out: Path, device_label: str) -> dict[str, dict]:
    results = {}
    for label, settings in smoke_cases(rounds):
        try:
            results[label] = run_once(settings, out / device_label, label.replace(" ", "").replace("+", "-"))
        except Exception as error:
            results[label] = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:160]}
        print(f"{device_label} {label}: {results[label]}", flush=True)
    return results


def smoke_report(rounds: int, out: Path) -> list[str]:
    device = pick_device()
    picked = smoke(rounds, out, device.type)
    child = subprocess.run(
        [sys.executable, __file__, "--smoke-child", "--rounds", str(rounds), "--out", str(out)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    print(child.stderr[-3000:], flush=True)
    cpu = json.loads((out / "cpu.json").read_text()) if (out / "cpu.json").exists() else {}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "no GPU"
    lines = [
        f"## Every method, digits E1 K=2 x 3 clients, {rounds} rounds: `{device}` ({name}) against the CPU",
        "",
        f"| method | accuracy ({device.type}) | accuracy (cpu) | difference | s ({device.type}) | s (cpu) | GPU MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, _ in smoke_cases(rounds):
        mine, theirs = picked[label], cpu.get(label, {"error": "no result from the CPU child"})
        if "error" in mine or "error" in theirs:
            shown = [result.get("error", result.get("accuracy")) for result in (mine, theirs)]
            lines.append(f"| {label} | {shown[0]} | {shown[1]} | | | | |")
            continue
        difference = mine["accuracy"] - theirs["accuracy"]
        lines.append(
            f"| {label} | {mine['accuracy']:.4f} | {theirs['accuracy']:.4f} | {difference:+.4f} | "
            f"{mine['seconds']:.1f} | {theirs['seconds']:.1f} | {mine['gpu_mib']:.0f} |"
        )
    return lines


def rerun_settings(folder: Path) -> dict:
    """The committed run's configuration, its data read from ``$FEDCOND_DATA_DIR`` here; a one-line
    error for a folder that is no run or a run this process cannot repeat."""
    if not (folder / "run.json").is_file() or not (folder / "history.csv").is_file():
        raise SystemExit(f"{folder} holds no run.json and history.csv: give a committed run's folder")
    settings = json.loads((folder / "run.json").read_text())["config"]
    method = get_method(settings["method"])
    if method.protocol == "federated" and method.conditioned and settings["normalisation"] == "federated":
        raise SystemExit(f"{folder}: normalisation=federated needs SecAgg+'s grid, absent here; rerun another")
    return {**settings, "verbose": False, "data-dir": ""}


def rerun_report(reruns: dict[Path, dict], out: Path) -> list[str]:
    device = pick_device()
    lines = [
        f"## Committed runs again on `{device}`, in this process (no Ray)",
        "",
        "| run | committed accuracy | here | committed s | here s | GPU MiB |",
        "|---|---|---|---|---|---|",
    ]
    for folder, settings in reruns.items():
        committed = final_row(folder, settings["dataset"])
        here = run_once(settings, out / "rerun", folder.name)
        committed_seconds = float(committed["elapsed_seconds"])
        lines.append(
            f"| {folder.name} | {float(committed['accuracy']):.4f} | {here['accuracy']:.4f} | "
            f"{committed_seconds:.0f} | {here['seconds']:.0f} | {here['gpu_mib']:.0f} |"
        )
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every method on digits, here and on the CPU")
    parser.add_argument("--smoke-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rerun", type=Path, nargs="*", default=[], help="committed run folders to run again")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cuda"))
    args = parser.parse_args()
    if not (args.smoke or args.smoke_child or args.rerun):
        parser.error("nothing to do: give --smoke and/or --rerun RUN_FOLDER")
    reruns = {folder: rerun_settings(folder) for folder in args.rerun}  # every folder checked before anything runs
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke_child:
        (args.out / "cpu.json").write_text(json.dumps(smoke(args.rounds, args.out, "cpu")))
        return
    lines = [f"# fedcond on {pick_device()}: torch {torch.__version__}", ""]
    if args.smoke:
        lines += [*smoke_report(args.rounds, args.out), ""]
    if reruns:
        lines += rerun_report(reruns, args.out)
    report = "\n".join(lines) + "\n"
    (args.out / "cuda_methods.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
