"""In-process Flower simulation of one run: the ServerApp in a thread, ClientApps on Ray actors.

This is what ``fedcond compare`` and ``fedcond sweep`` call once per (method, seed) and what the
tests use; ``fedcond run`` goes through ``flwr run`` instead. Ray binds to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.clientapp.typing import Mod
from flwr.common.logger import FLOWER_LOGGER
from flwr.simulation import run_simulation

from fedcond import stopping
from fedcond.config import RunConfig
from fedcond.federation.client_app import make_client_app
from fedcond.federation.server_app import RunStopped, make_server_app


def backend_config(cpus_per_client: float = 1.0, gpus_per_client: float = 0.0) -> dict[str, dict[str, object]]:
    """Ray settings: one virtual client per ``cpus_per_client`` cores, all sockets on loopback."""
    return {
        "client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client},
        # "local": a Ray of its own, never a cluster some `ray start` on this machine recorded in
        # /tmp/ray/ray_current_cluster (plain ray.init() joins that one); RAY_ADDRESS still wins.
        "init_args": {"include_dashboard": False, "_node_ip_address": "127.0.0.1", "address": "local"},
    }


def simulate(
    config: RunConfig,
    num_supernodes: int | None = None,
    cpus_per_client: float = 1.0,
    gpus_per_client: float = 0.0,
    quiet: bool = False,
    client_mods: Sequence[Mod] = (),
    log: Path | None = None,
) -> None:
    """Run ``config`` to the end (its results folder records whether it finished or failed).

    ``quiet`` keeps Flower's INFO and WARNING lines off the terminal (errors still show),
    for callers that report progress themselves. With ``log``, everything Flower, Ray and the
    apps print goes to that file instead of the terminal (``fedcond compare`` and ``sweep``: each
    run's ``flower.log``). ``client_mods`` are Flower mods around every client message (the tests
    inject faults with them).
    """
    level = FLOWER_LOGGER.level
    if quiet:
        FLOWER_LOGGER.setLevel(logging.ERROR)
    backend = backend_config(cpus_per_client, gpus_per_client)
    on_ray = clients_on_ray()
    try:
        with (
            output_to(log) if log is not None else contextlib.nullcontext(),
            stopping.remote_clients() if on_ray else contextlib.nullcontext(),
        ):
            if on_ray:
                start_ray(backend)
            run_simulation(
                server_app=make_server_app(config),
                client_app=make_client_app(config, client_mods),
                num_supernodes=num_supernodes or config.num_clients,
                backend_config=backend,  # type: ignore[arg-type]
            )
    except RunStopped:
        pass  # the ServerApp stopped the run: its line is printed, its folder says failed and why
    finally:
        FLOWER_LOGGER.setLevel(level)
        if on_ray:
            stop_ray()


def clients_on_ray() -> bool:
    """Whether Flower's Simulation Runtime runs the ClientApps on Ray's actors: its backend is its own
    Ray backend (the tests put one in its place that runs them in this process, tests/thread_backend.py)."""
    from flwr.server.superlink.fleet.vce.backend import raybackend

    return raybackend.RayBackend.__module__ == raybackend.__name__


def start_ray(backend: Mapping[str, Any]) -> None:
    """Start Ray as Flower's Ray backend would (``RayBackend.init_ray`` with ``run_simulation``'s
    defaults), which then finds it started; here, so that a compare's or sweep's stop handlers
    (``fedcond.stopping``) are put back after ``ray.init`` has put Ray's own SIGTERM handler in place:
    a SIGTERM then stops the run as Ctrl+C does, never through Ray's handler, which ends Ray's
    processes first and a round could record the clients it took as failures."""
    import ray
    from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG

    if ray.is_initialized():
        return
    init_args: dict[str, Any] = {
        "logging_level": DEFAULT_SIMULATION_CONFIG.init_args_logging_level,
        "log_to_driver": DEFAULT_SIMULATION_CONFIG.init_args_log_to_driver,
        "include_dashboard": False,
        **backend.get("init_args", {}),
    }
    # As Flower's backend does: Ray's processes import the apps from this process's sys.path.
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    try:
        ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init_args)
    finally:
        stopping.install()


def stop_ray() -> None:
    """Shut down the Ray this process started, if Flower has not: a run stopped before its backend
    existed, or in the middle of ``ray.init`` (not initialised yet, some of its processes started:
    ``ray.shutdown`` ends those too). Nothing when Ray was never imported."""
    ray = sys.modules.get("ray")
    if ray is not None:
        ray.shutdown()


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """This process's printed output, Flower's log records (every level), Python warnings and the
    lines Ray forwards from its actors, into ``path`` (appended); the terminal gets none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        file_handler = logging.StreamHandler(handle)
        file_handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s: %(message)s"))
        console = [h for h in FLOWER_LOGGER.handlers if isinstance(h, logging.StreamHandler)]
        levels = [h.level for h in console]
        logger_level = FLOWER_LOGGER.level
        for handler in console:
            handler.setLevel(logging.CRITICAL + 1)
        FLOWER_LOGGER.addHandler(file_handler)
        FLOWER_LOGGER.setLevel(logging.DEBUG)
        try:
            with (
                warnings.catch_warnings(),
                contextlib.redirect_stdout(handle),
                contextlib.redirect_stderr(handle),
            ):
                # Ray prints its warnings and the actors' lines to sys.stderr as they come: here, the file.
                warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: print(
                    warnings.formatwarning(message, category, filename, lineno, line), file=sys.stderr
                )
                yield
        finally:
            FLOWER_LOGGER.removeHandler(file_handler)
            FLOWER_LOGGER.setLevel(logger_level)
            for handler, handler_level in zip(console, levels, strict=True):
                handler.setLevel(handler_level)
