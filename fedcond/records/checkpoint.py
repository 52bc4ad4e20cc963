"""Checkpoints, and resuming a run from its last finished round in its own folder.

After every round the ServerApp (after every epoch, the pooled protocol; with ``checkpoint-every``
above 1, every that many rounds and after the last) replaces the run's one checkpoint,
``checkpoint.pt``: the last finished round, the history so far, the named models the server holds
(the global model, one per cluster, one per client...) and the plain values it needs to go on (the
published fingerprint mean and standard deviation, cluster assignments, a pooled run's optimiser
momentum and batch-order generator). It is written atomically (a temporary file,
fsync, rename): a run killed at any moment leaves the previous checkpoint or the new one, never
part of one. The format is ``torch.save`` of plain tensors, numbers, strings, lists and dicts, read
back with ``weights_only=True``, so loading one runs no pickled code.

Nothing random needs saving: the server's randomness is a function of (seed, round) (Gossip's
pairings; initial models come from the seed), each client's of (seed, round, partition id) (its
batch order, ``fedcond/federation/client.py``), and a pooled run's batch-order generator is saved. A
resumed run of a method whose state is all on the server therefore computes exactly what the
uninterrupted run would have. State kept on clients (Ditto's personal models, Local's models, in
Flower's ``context.state``) is not in the checkpoint: a resumed run is a new Flower run, whose
``context.state`` starts empty, so those models start afresh (``run.json`` says so).

``resume=<run folder>`` continues a run: its settings are the ones its ``run.json`` records, and a
resume is refused (one line, before anything starts) when the folder has no checkpoint, the run is
still going (its folder's lock is held) or already finished, or the given settings differ from the
recorded ones. Only where things are and how the run talks may change (``FREE_ON_RESUME``), and
``num-server-rounds`` may grow past the last finished round, which also extends a finished run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcond import stopping
from fedcond.config import Option, RunConfig, canonical_record
from fedcond.errors import FedcondError
from fedcond.records import locks
from fedcond.records.history import (
    CHECKPOINT_EVERY,
    FREE_ON_RESUME,
    PATH_KEYS,
    RESUME,
    RUN_LOCK,
    RoundRecord,
    results_base,
)

CHECKPOINT_FILE = "checkpoint.pt"
FORMAT_VERSION = 1
#: The name of the global model Flower passes around, among a checkpoint's models.
GLOBAL_MODEL = "global"


def checkpoint_due(config: RunConfig, finished_round: int) -> bool:
    """Whether the checkpoint is saved after ``finished_round``: every ``checkpoint-every`` rounds
    and after the last (a finished run's checkpoint is what extending it resumes from)."""
    return finished_round % CHECKPOINT_EVERY.of(config) == 0 or finished_round >= config.num_server_rounds


@dataclass
class Checkpoint:
    """What a run needs to continue after ``round``: its history, named models and plain values."""

    round: int
    history: list[RoundRecord]
    models: dict[str, list[np.ndarray]] = field(default_factory=dict)
    #: Plain values (numbers, strings, bytes, lists, dicts) and tensors (optimiser, generator states).
    values: dict[str, Any] = field(default_factory=dict)


def checkpoint_path(folder: Path) -> Path:
    return folder / CHECKPOINT_FILE


def save_checkpoint(folder: Path, checkpoint: Checkpoint) -> int:
    """Replace ``folder``'s checkpoint with ``checkpoint`` atomically; returns its size in bytes."""
    payload = {
        "format": FORMAT_VERSION,
        "round": checkpoint.round,
        "history": [dataclasses.asdict(record) for record in checkpoint.history],
        "models": {
            # np.require keeps a 0-d array 0-d (BatchNorm's num_batches_tracked); ascontiguousarray made it (1,).
            name: [torch.from_numpy(np.require(array, requirements="C")) for array in model]
            for name, model in checkpoint.models.items()
        },
        "values": checkpoint.values,
    }
    path = checkpoint_path(folder)
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        # Never the checkpoint of a round a stop (Ctrl+C, SIGTERM) came during: the previous one stays.
        with stopping.committing(f"round {checkpoint.round}'s checkpoint"):
            os.replace(temporary, path)
            # The rename itself is durable only once the folder's entry is on disk.
            directory = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
    except stopping.Interrupted:
        temporary.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def load_checkpoint(folder: Path) -> Checkpoint | None:
    """``folder``'s checkpoint, or None when it has none; an unreadable one is a one-line error."""
    path = checkpoint_path(folder)
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {payload.get('format')!r}, this fedcond reads {FORMAT_VERSION}")
        return Checkpoint(
            round=int(payload["round"]),
            history=[RoundRecord(**record) for record in payload["history"]],
            models={name: [tensor.numpy() for tensor in model] for name, model in payload["models"].items()},
            values=dict(payload["values"]),
        )
    except Exception as error:
        raise FedcondError(
            f"{path} cannot be read ({type(error).__name__}: {' '.join(str(error).split())[:200]}); "
            "start the run again without resume"
        ) from None


# -- resuming ---------------------------------------------------------------------------------------
def resume_folder(config: RunConfig) -> Path | None:
    """The run folder ``config`` resumes, or None for a new run."""
    value = RESUME.of(config)
    return Path(value).expanduser().resolve() if value else None


def run_info(folder: Path) -> dict[str, Any]:
    """A run folder's ``run.json``, or a one-line error saying what ``resume=`` needs."""
    try:
        return json.loads((folder / "run.json").read_text())
    except FileNotFoundError:
        raise FedcondError(
            f"resume={folder}: no run.json there; give the folder of a run (results-dir/run-name)"
        ) from None
    except ValueError as error:
        raise FedcondError(f"resume={folder}: its run.json is not valid JSON ({error}); start a new run") from None


def recorded_settings(folder: Path, info: Mapping[str, Any]) -> dict[str, Any]:
    """The settings ``run.json`` records, with their paths absolute again and the run in ``folder``."""
    mapping = dict(info.get("config", {}))
    for key in PATH_KEYS:
        if mapping.get(key):
            mapping[key] = str((folder / str(mapping[key])).resolve())
    mapping.update({"results-dir": str(folder.parent), "run-name": folder.name})
    mapping.pop(RESUME.key, None)
    return mapping


def contradictions(config: RunConfig, recorded: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every setting of ``config`` a resume may not change and that differs from the record, as
    key -> (its value in ``config``, the recorded value), by key.

    ``run.json`` records resolved settings (dataset defaults filled in), so ``config`` is compared
    resolved; a key it lacks (a setting newer than the run) is not compared.
    """
    wanted = config.resolved().to_mapping()
    recorded = canonical_record(recorded)
    return {
        key: (wanted[key], recorded[key])
        for key in sorted(wanted)
        if key not in FREE_ON_RESUME and key in recorded and wanted[key] != recorded[key]
    }


def resume_refusal(folder: Path, differing: Mapping[str, tuple[Any, Any]], given: Collection[str] | None) -> str:
    """The one line refusing a resume whose settings differ from the record: the settings given with
    other values (they may not change), those left out whose defaults differ from the record, and
    every one of them as ``key=value`` to repeat.

    ``given``: the keys the user gave (None: unknown). Where a resume's settings come from matters:
    ``fedcond run resume=FOLDER`` fills every key it is not given from the record, so only given
    keys can differ; ``flwr run`` and ``fedcond submit`` fill them from the app's defaults
    (pyproject.toml), so a recorded value that is not the default must be given again, and "leave it
    out" would be wrong advice there. Giving the recorded value is right on every path.
    """

    def values(keys: list[str], side: str) -> str:
        return ", ".join(
            f"{key} ({side} {json.dumps(differing[key][0])}, recorded {json.dumps(differing[key][1])})" for key in keys
        )

    changed = [key for key in differing if given is None or key in given]
    defaulted = [key for key in differing if key not in changed]
    parts = ["a resumed run keeps its recorded settings"]
    if changed:
        parts.append(f"these may not change: {values(changed, 'given' if given is not None else 'here')}")
    if defaulted:
        parts.append(f"these were left out, so the app's defaults were taken: {values(defaulted, 'default')}")
    repeat = " ".join(f"{key}={json.dumps(recorded)}" for key, (_, recorded) in differing.items())
    return f"resume={folder}: {'; '.join(parts)}; give them as recorded: {repeat}"


def resume_settings(folder: Path, overrides: Mapping[str, Any], declared: Sequence[Option]) -> RunConfig:
    """``fedcond run resume=FOLDER [key=value ...]``: the recorded settings, and the command line's
    values over them (a value that contradicts a recorded one is refused by ``check_resume``)."""
    folder = folder.expanduser().resolve()
    given = {key: value for key, value in overrides.items() if key != RESUME.key}
    if given.get("data-dir"):
        given["data-dir"] = str(Path(str(given["data-dir"])).expanduser().resolve())
    mapping = {**recorded_settings(folder, run_info(folder)), **given, RESUME.key: str(folder)}
    try:
        return RunConfig.from_mapping(mapping, declared)
    except FedcondError as error:
        raise FedcondError(f"resume={folder}: {error}") from None


def check_resume(config: RunConfig, given: Collection[str] | None = None) -> Checkpoint:
    """Every check of ``resume=`` before anything starts; returns the checkpoint to continue from.
    ``given``: the settings the user gave, the rest being defaults (None: unknown), for the advice."""
    folder = resume_folder(config)
    if folder is None:
        raise FedcondError("resume is empty; give resume=<run folder>")
    info = run_info(folder)
    differing = contradictions(config, recorded_settings(folder, info))
    if differing:
        raise FedcondError(resume_refusal(folder, differing, given))
    if config.run_name and results_base(config) / config.run_name != folder:
        raise FedcondError(
            f"resume={folder}: a resumed run stays in its folder; leave out results-dir and run-name "
            f"(they name {results_base(config) / config.run_name})"
        )
    holder = locks.holder_of(folder / RUN_LOCK)
    if holder is not None:
        raise FedcondError(f"resume={folder}: the run is still going (process {holder}); wait for it or stop it first")
    checkpoint = load_checkpoint(folder)
    if checkpoint is None:
        raise FedcondError(
            f"resume={folder}: no {CHECKPOINT_FILE} there (the run stopped before finishing round 1); "
            "start it again without resume"
        )
    rounds = config.num_server_rounds
    if rounds <= checkpoint.round:
        if info.get("status") == "finished":
            raise FedcondError(
                f"resume={folder}: the run already finished its {checkpoint.round} rounds; to extend it, "
                f"give num-server-rounds above {checkpoint.round}"
            )
        raise FedcondError(
            f"resume={folder}: num-server-rounds={rounds} is not above the {checkpoint.round} rounds already "
            "finished; give a larger num-server-rounds or leave it out"
        )
    return checkpoint


def check_resumed_rounds(config: RunConfig, given: Collection[str]) -> None:
    """A resume through ``flwr run`` (or ``fedcond submit``) must say how many rounds the run has:
    Flower fills a key it is not given from pyproject.toml (10 rounds), which would silently extend a
    shorter run, and the clients read the count from the same run config. ``given``: the keys of
    ``--run-config`` (Flower's ``override_config``); ``fedcond run resume=`` passes every recorded
    setting."""
    folder = resume_folder(config)
    if folder is None or "num-server-rounds" in given:
        return
    recorded = run_info(folder).get("config", {}).get("num-server-rounds")
    raise FedcondError(
        f"resume={folder}: give num-server-rounds in --run-config (the run recorded {recorded}: that many finishes "
        f"it, more extends it); left out, pyproject.toml's {config.num_server_rounds} would be taken"
    )


def resumption_note(checkpoint: Checkpoint, info: Mapping[str, Any], restarted_on_clients: str = "") -> dict[str, Any]:
    """What ``run.json`` records of one resume: from which round, when, how the run had stopped,
    and which state kept on clients started afresh (empty when none)."""
    previous = str(info.get("status", "missing"))
    return {
        "from_round": checkpoint.round + 1,
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "previous_status": f"{previous}: {info['error']}" if "error" in info else previous,
        "restarted_on_clients": restarted_on_clients or None,
    }
