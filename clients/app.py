"""The Flower ClientApp: one fedcond client per node, holding only its own partition."""

from __future__ import annotations

from flwr.client import Client, ClientApp
from flwr.common import Context

from fedcond.client_data import load_client_data
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.methods import get_method


def build_client(context: Context, config: RunConfig) -> Client:
    """The client of node ``context.node_config['partition-id']`` under ``config``."""
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config.get("num-partitions", config.num_clients))
    if num_partitions != config.num_clients:
        raise FedcondError(
            f"this node was started for {num_partitions} partitions but num-clusters x "
            f"(clients-per-cluster + held-out-clients) = {config.num_clients}; make them equal"
        )
    method = get_method(config.method)
    data = load_client_data(config, partition_id)
    return method.make_client(config, data, context, method.conditioned).to_client()


def make_client_app(config: RunConfig | None = None) -> ClientApp:
    """A ClientApp reading its settings from the run config, or from ``config`` when given (tests)."""

    def client_fn(context: Context) -> Client:
        return build_client(context, config or RunConfig.from_mapping(context.run_config))

    return ClientApp(client_fn=client_fn)


app = make_client_app()
