"""Flower's local SuperLink of another environment is never reused silently by ``fedcond run``.

A stand-in ``flower-superlink`` (a Python script of that name that only waits) is started from
another folder with the ``--log-file`` of a Flower home under ``tmp_path``, as ``flwr run`` starts
the real one, so that ``local_superlink.find`` finds it; it is stopped by its PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from fedcond.tools import cli, local_superlink
from fedcond.tools.cli import main
from fedcond.tools.flwr_commands import executable, flower_environment


@contextmanager
def stand_in_superlink(folder: Path, home: Path, environment: dict[str, str]) -> Iterator[psutil.Process]:
    """``folder/bin/flower-superlink`` running for Flower home ``home``, as ``local_superlink.find`` sees it."""
    script = folder / "bin" / "flower-superlink"
    script.parent.mkdir(parents=True)
    script.write_text("import time\ntime.sleep(600)\n")
    command = [sys.executable, str(script), "--insecure", "--simulation", "--log-file",
               str(local_superlink.log_file(home))]  # fmt: skip
    process = subprocess.Popen(command, env=environment, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while (found := local_superlink.find(home)) is None or found.pid != process.pid:
            assert time.monotonic() < deadline and process.poll() is None, "the stand-in never showed up"
            time.sleep(0.1)
        yield found
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def test_fedcond_run_refuses_a_local_superlink_of_another_environment_and_stop_superlink_ends_it(
    tmp_path, monkeypatch, capsys
):
    home = tmp_path / "flwr-home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    monkeypatch.setattr(cli, "stream_filtered", lambda *arguments, **options: pytest.fail("flwr run was started"))
    other = tmp_path / "other-venv"
    with stand_in_superlink(other, home, flower_environment()) as superlink:
        settings = ["num-clusters=2", "clients-per-cluster=1", "num-server-rounds=1", f"results-dir={tmp_path / 'r'}"]
        assert main(["run", *settings]) == 2
        printed = capsys.readouterr()
        (line,) = printed.err.splitlines()
        theirs, ours = other / "bin" / "flower-superlink", executable("flower-superlink")
        assert line == (
            f"fedcond: error: Flower's local SuperLink of {home} (PID {superlink.pid}) was started from another "
            f"environment: it runs {theirs}, this one has {ours}; "
            "flwr run would reuse it as it is: stop it with fedcond stop-superlink (or make stop-superlink) once its "
            "runs are over, then run again"
        )
        assert superlink.is_running()  # refused, not stopped: it may be serving another terminal's run
        assert not (tmp_path / "r").exists()  # and nothing was started or written
        assert main(["stop-superlink"]) == 0  # the line's fix
        assert f"fedcond: stopped Flower's local SuperLink of {home} (PID {superlink.pid})" in capsys.readouterr().out
        assert not superlink.is_running()


def test_a_local_superlink_started_with_other_settings_or_before_a_reinstall_is_foreign(tmp_path, monkeypatch):
    home = tmp_path / "flwr-home"
    environment = {**flower_environment(), "PYTHONPATH": str(tmp_path / "checkout-a")}
    with stand_in_superlink(tmp_path / "venv", home, environment) as superlink:
        ours = tmp_path / "venv" / "bin" / "flower-superlink"  # the same executable: the environment decides
        assert local_superlink.foreign(superlink, environment, ours) is None
        checkout_b = {**environment, "PYTHONPATH": str(tmp_path / "checkout-b")}
        assert local_superlink.foreign(superlink, checkout_b, ours) == (
            f"with PYTHONPATH={tmp_path / 'checkout-a'}, and this run has PYTHONPATH={tmp_path / 'checkout-b'}"
        )
        online = {
            key: value for key, value in environment.items() if key != "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"
        }
        assert local_superlink.foreign(superlink, online, ours) == (
            "with FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1, and this run has "
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=(unset)"
        )
        # Flower installed again (another version) after it started: it still runs the old one.
        assert set(local_superlink.installed_at()) == {"flwr", "fedcond"}
        monkeypatch.setattr(local_superlink, "installed_at", lambda: {"flwr": time.time() + 1})
        why = local_superlink.foreign(superlink, environment, ours)
        assert why is not None and why.startswith("before flwr 1.42.0 was installed here: it runs the version")


def test_the_local_superlink_flwr_run_starts_for_this_environment_is_not_foreign(tmp_path):
    """Flower's own local SuperLink command (flwr/cli/local_superlink.py), started as ``flwr run`` starts
    it for ``fedcond run`` (this environment, free ports): reused without a word."""
    from fedcond.tools.deploy import free_ports, wait_until_listening

    home = tmp_path / "flwr-home"
    http_port, control_port = free_ports(2)
    environment = flower_environment(FLWR_HOME=str(home), FLWR_DISABLE_UPDATE_CHECK="1")
    log = local_superlink.log_file(home)
    log.parent.mkdir(parents=True)
    command = [
        "flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
        "--control-api-address", f"127.0.0.1:{control_port}", "--host", "127.0.0.1", "--port", str(http_port),
        "--log-file", str(log), "--database", str(log.parent / "state.db"),
    ]  # fmt: skip
    process = subprocess.Popen(command, env=environment, cwd=tmp_path, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until_listening(http_port, process, log)  # type: ignore[arg-type]
        found = local_superlink.find(home)
        assert found is not None and found.pid == process.pid
        assert local_superlink.foreign(found, environment, Path(executable("flower-superlink"))) is None
        local_superlink.check_reusable(home, environment, Path(executable("flower-superlink")))
    finally:
        # By PID, with what it started (its SuperExec runs in a session of its own).
        local_superlink.terminate(psutil.Process(process.pid))
        process.wait(timeout=30)
