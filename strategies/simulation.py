"""In-process Flower simulation of one run: the ServerApp in a thread, ClientApps on Ray actors.

This is what ``fedcond compare`` and ``fedcond sweep`` call once per (method, seed) and what the
tests use; ``fedcond run`` goes through ``flwr run`` instead. Ray binds to 127.0.0.1 only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from flwr.clientapp.typing import Mod
from flwr.common.logger import FLOWER_LOGGER
from flwr.simulation import run_simulation

from clients.app import make_client_app
from fedcond.config import RunConfig
from strategies.server_app import make_server_app


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
) -> None:
    """Run ``config`` to the end (its results folder records whether it finished or failed).

    ``quiet`` keeps Flower's INFO and WARNING lines off the terminal (errors still show),
    for callers that report progress themselves. ``client_mods`` are Flower mods around every
    client message (the tests inject faults with them).
    """
    level = FLOWER_LOGGER.level
    if quiet:
        FLOWER_LOGGER.setLevel(logging.ERROR)
    try:
        run_simulation(
            server_app=make_server_app(config),
            client_app=make_client_app(config, client_mods),
            num_supernodes=num_supernodes or config.num_clients,
            backend_config=backend_config(cpus_per_client, gpus_per_client),  # type: ignore[arg-type]
        )
    finally:
        FLOWER_LOGGER.setLevel(level)
