"""``fedcond submit CONNECTION key=value ...``: a deployed run submitted, followed to its end, and its
outcome as the exit status.

``flwr run --stream`` exits 0 whatever the run did (two nodes claiming one partition, a partition
file of another seed, a round stopped by ``min-answered-fraction``), so a script cannot tell, and a
misspelled ``--run-config`` key gets only Flower's ``[code: 15] Invalid run configuration`` (the key
is named in the SuperLink's log alone). This command:

1. checks every setting as ``fedcond run --dry-run`` does, before anything is submitted: a bad key
   or value is one line naming the fix (exit 2); so is a resume (``resume=FOLDER``, its folder here)
   that the ServerApp would refuse: settings that differ from the record (those left out take the
   app's defaults here, as with ``flwr run``), or no ``num-server-rounds``;
2. submits the app with ``flwr run APP CONNECTION --stream --run-config ...`` and shows its output
   as it comes (the ServerApp's ``fedcond:`` lines and every round);
3. asks the SuperLink how the run ended (``flwr list CONNECTION --run-id ID --format json``) and exits
   0 when it completed, 1 with ``fedcond: error: run ID ...: <the reason>`` otherwise.

Ctrl+C detaches, as it does from ``flwr run --stream``: the run goes on, and the line printed says
how to follow or stop it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from fedcond.errors import FedcondError
from fedcond.records.checkpoint import check_resumed_rounds
from fedcond.tools.flwr_commands import (
    app_directory,
    executable,
    flower_environment,
    read_overrides,
    settings_from,
    to_run_config_string,
)

#: What ``flwr run`` prints once the SuperLink accepted the run (flwr/cli/run/run.py).
STARTED = re.compile(r"Successfully started run (\d+)")
#: ``flwr list``'s status of a run that ended well.
COMPLETED = "finished:completed"
#: How Flower's ServerApp runner begins a failed run's details (flwr/superlink/runtime/run_serverapp.py).
SERVERAPP_FAILED = "ServerApp failed with exception: "


def submit(connection: str, assignments: Sequence[str], override_file: str | None, app: str | None) -> int:
    """Check, submit, follow; 0 when the run completed, 1 when it did not (the reason printed)."""
    config = settings_from(assignments, override_file)  # every setting checked; the data lives on the nodes
    overrides = read_overrides(assignments, override_file)
    # What the ServerApp would refuse of a resume, said here in one line rather than submitted to fail.
    check_resumed_rounds(config, overrides.keys())
    command = [executable("flwr"), "run", str(Path(app).resolve() if app else app_directory()), connection,
               "--stream", "--run-config", to_run_config_string(overrides)]  # fmt: skip
    environment = flower_environment()
    run_id: str | None = None
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace")  # fmt: skip
    assert process.stdout is not None
    try:
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if run_id is None and (started := STARTED.search(line)):
                run_id = started.group(1)
        returncode = process.wait()
    except KeyboardInterrupt:
        process.terminate()
        where = f"run {run_id}" if run_id else "the run, if it started,"
        ident = run_id or "RUN_ID"
        print(f"fedcond: detached; {where} goes on: flwr log {ident} {connection} --stream follows it, "
              f"flwr stop {ident} {connection} stops it", file=sys.stderr, flush=True)  # fmt: skip
        return 130
    if run_id is None:
        raise FedcondError(
            f"flwr run did not start a run (exit status {returncode}; its output above says why): check the "
            f"connection {connection!r} in your Flower configuration and that the SuperLink runs"
        )
    status, details = run_status(connection, run_id, environment)
    if status == COMPLETED:
        print(f"fedcond: run {run_id} completed", flush=True)
        return 0
    # The ServerApp's own line is the reason: Flower's wrapper around it says nothing more.
    reason = details.removeprefix(SERVERAPP_FAILED) or "no reason recorded"
    print(f"fedcond: error: run {run_id} {status}: {reason}", file=sys.stderr, flush=True)
    return 1


def run_status(connection: str, run_id: str, environment: dict[str, str]) -> tuple[str, str]:
    """(status, details) of run ``run_id`` as the SuperLink records it (``finished:failed``, the
    ServerApp's one-line reason)."""
    listed = subprocess.run(
        [executable("flwr"), "list", connection, "--run-id", run_id, "--format", "json"], env=environment,
        capture_output=True, text=True, errors="replace", check=False,
    )  # fmt: skip
    try:
        answer = json.loads(listed.stdout)
        (run,) = [run for run in answer.get("runs", []) if str(run.get("run-id")) == run_id]
    except (ValueError, AttributeError):
        # Flower's --format json answers a failure with a JSON object of its own: its message, not the blob.
        raise FedcondError(
            f"flwr list could not say how run {run_id} ended ({flwr_failure(listed.stdout, listed.stderr)}); "
            f"flwr list {connection} --run-id {run_id} shows it once that is fixed"
        ) from None
    return str(run.get("status", "unknown")), str(run.get("status-details", ""))


def flwr_failure(output: str, errors: str = "") -> str:
    """The last line of what a ``flwr ... --format json`` command said when it failed: the
    ``error-message`` of Flower's ``{"success": false, ...}``, else its last line of output."""
    try:
        answer = json.loads(output)
        message = str(answer["error-message"]) if "error-message" in answer else "it lists no such run"
    except (ValueError, TypeError):
        message = f"{output}\n{errors}"
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
