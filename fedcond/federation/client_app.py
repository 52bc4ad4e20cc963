"""The Flower ClientApp: one fedcond client per node, holding only its own partition.

A node says which client it is with its node config (``flower-supernode --node-config``; in a
simulation Flower fills in the first two):
- ``partition-id``, ``num-partitions``: its index among num-clusters x clients-per-cluster clients;
- ``partition-file`` (optional): its own ``partition-<id>.npz`` from ``fedcond export-partitions``,
  so that its machine holds nothing but its own samples;
- ``data-dir`` (optional): this machine's dataset folder, overriding the run config's ``data-dir``
  (used to compute the partition when there is no partition file, and to find a fingerprint
  encoder's data);
- ``client-state-dir`` (optional): this machine's folder for the models its client keeps between
  rounds (Ditto's personal model, Local's), overriding the run config's.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.client import Client, ClientApp
from flwr.clientapp.typing import Mod
from flwr.common import Context

from fedcond.config import RunConfig
from fedcond.data.client_data import ClientData, cached_client_data, load_partition_file
from fedcond.errors import FedcondError
from fedcond.federation.client import FedcondClient
from fedcond.federation.clipping_mod import client_dp_clipping_mod
from fedcond.federation.secagg_mod import secure_aggregation_mod
from fedcond.model.store import CLIENT_STATE_DIR
from fedcond.pooled import POOLED_METHODS, not_a_federation
from fedcond.shared_options import CLIENT_SHARED_OPTIONS
from fedcond.variants import client_path, with_variant_settings


def client_class(method: str) -> type[FedcondClient]:
    """The method's client class, found by its name (``Client`` in ``clients/<method>.py``, a named
    variant's base method's): its own module alone, nothing of the server's strategies."""
    if method in POOLED_METHODS:
        raise not_a_federation(method)
    module, _, name = client_path(method).partition(":")
    where = module.removeprefix("fedcond.").replace(".", "/") + ".py"  # the checkout's clients/<method>.py
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError as error:  # ModuleNotFoundError included: unknown only when it is this module
        if isinstance(error, ModuleNotFoundError) and error.name == module:
            raise FedcondError(f"unknown method '{method}': no {where}; fedcond list names them") from None
        raise FedcondError(f"{where} cannot be imported: {error}") from error
    if not (isinstance(found, type) and issubclass(found, FedcondClient)):
        what = "missing" if found is None else repr(found)
        raise FedcondError(f"{where}: {name} is {what}, not a FedcondClient subclass; every client module has one")
    return found


def client_run_config(mapping: Mapping[str, Any]) -> RunConfig:
    """The run configuration as a ClientApp reads it: the core settings and the options of its own
    client class and of the shared client settings, typed, checked and resolved (dataset defaults
    filled in); other methods' and the server's options kept as given (the ServerApp checked them
    all before any client was asked). Read once per run and process: every message of a run brings
    the same raw settings, and its mods and client get this one typed object."""
    return _typed_run_config(tuple(sorted(mapping.items())))


@functools.lru_cache(maxsize=8)
def _typed_run_config(items: tuple[tuple[str, Any], ...]) -> RunConfig:
    settings = with_variant_settings(dict(items))
    own = (*client_class(str(settings.get("method", RunConfig.method))).options, *CLIENT_SHARED_OPTIONS)
    return RunConfig.from_mapping(settings, own, keep_unknown=True).resolved()


def build_client(context: Context, config: RunConfig) -> Client:
    """The client of node ``context.node_config['partition-id']`` under ``config``."""
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config.get("num-partitions", config.num_clients))
    if num_partitions != config.num_clients:
        raise FedcondError(
            f"this node was started for {num_partitions} partitions but num-clusters x "
            f"(clients-per-cluster + held-out-clients) = {config.num_clients}; make them equal"
        )
    if "data-dir" in context.node_config:
        config = config.replace(data_dir=str(context.node_config["data-dir"]))
    if CLIENT_STATE_DIR.key in context.node_config:
        config = CLIENT_STATE_DIR.set(config, str(context.node_config[CLIENT_STATE_DIR.key]))
    client = client_class(config.method)
    data = node_data(context, config, partition_id)
    return client(config, data, context).to_client()


def node_data(context: Context, config: RunConfig, partition_id: int) -> ClientData:
    """This node's data: its partition file when the node config names one, else computed from the dataset."""
    partition_file = context.node_config.get("partition-file")
    if partition_file:
        return load_partition_file(Path(str(partition_file)).expanduser(), config, partition_id)
    return cached_client_data(config, partition_id)


@functools.cache
def threads_for_this_actor() -> None:
    """In a simulation, torch gets as many threads as Ray gave this actor CPUs
    (``client-resources-num-cpus``), once per process.

    Ray sets ``OMP_NUM_THREADS`` to an actor's CPUs only when the environment does not set it
    already; with ``OMP_NUM_THREADS=2`` inherited on a 2-core machine, two actors ran four threads on
    two cores and every round took 4x as long (17 s instead of 4 s, docs/performance.md). Deployed
    SuperNodes (no Ray) keep what their environment says.
    """
    ray = sys.modules.get("ray")  # never imported here: a deployed ClientApp process has no Ray
    if ray is None or not ray.is_initialized():
        return
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if cpus:
        torch.set_num_threads(max(1, int(cpus)))


def make_client_app(config: RunConfig | None = None, mods: Sequence[Mod] = ()) -> ClientApp:
    """A ClientApp reading its settings from the run config, or from ``config`` when given (tests).

    ``mods`` are Flower mods wrapped around every message the clients handle, outside fedcond's own
    (the tests inject faults and record messages with them).
    """

    def settings(context: Context) -> RunConfig:
        return config or client_run_config(context.run_config)

    def client_fn(context: Context) -> Client:
        threads_for_this_actor()
        return build_client(context, settings(context))

    # SecAgg+ wraps the clipping (client-dp = "client-side"): a client clips its update, then masks it.
    fedcond_mods = [secure_aggregation_mod(settings), client_dp_clipping_mod]
    return ClientApp(client_fn=client_fn, mods=[*mods, *fedcond_mods])


app = make_client_app()
