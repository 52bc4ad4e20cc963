"""Profile the ClientApp's per-message path in one process, without Ray: what each message costs.

Drives ``fedcond.federation.client_app`` exactly as a Ray actor does (``app(message, context)`` with legacy fit and
evaluate messages carrying the global model), for a few clients and rounds, under cProfile:

    python benchmarks/profile_client.py --dataset digits --clients 4 --rounds 2
    python benchmarks/profile_client.py --dataset mnist --data-fraction 0.02 --data-dir DIR

It prints the top functions by cumulative time and a count of model builds and partition slices
per message, the evidence behind docs/performance.md's "where the time goes".
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.common import EvaluateIns, FitIns, ndarrays_to_parameters
from flwr.compat.common.recorddict_compat import evaluateins_to_recorddict, fitins_to_recorddict
from flwr.supercore.task_identity import TaskIdentity

from fedcond.data.datasets import dataset_spec
from fedcond.federation.client_app import make_client_app
from fedcond.federation.methods import get_method, run_config
from fedcond.model.networks import build_run_model, get_weights


def messages_for(weights: list, server_round: int) -> list[tuple[str, RecordDict]]:
    parameters = ndarrays_to_parameters(weights)
    config = {"server-round": server_round}
    return [
        (MessageType.TRAIN, fitins_to_recorddict(FitIns(parameters, config), keep_input=True)),
        (MessageType.EVALUATE, evaluateins_to_recorddict(EvaluateIns(parameters, config), keep_input=True)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--clients", type=int, default=2, help="clients per cluster")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data-fraction", type=float, default=1.0)
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--sort", default="cumulative")
    parser.add_argument("--filter", default="", help="only functions whose path matches this regex")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = run_config({
        "method": args.method, "dataset": args.dataset, "num-clusters": args.clusters,
        "clients-per-cluster": args.clients, "data-fraction": args.data_fraction, "data-dir": args.data_dir,
        "normalisation": "none" if get_method(args.method).conditioned else "federated",
    })  # fmt: skip
    app = make_client_app(config)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = (
        1,
        1,
        1,
    )  # what the runtime sets before it builds messages
    num = config.num_clients
    contexts = [Context(1, 100 + i, {"partition-id": i, "num-partitions": num}, RecordDict(), {}) for i in range(num)]
    resolved = config.resolved()
    # The dataset's class count, not the scenario: the first message must pay for decoding as on an actor.
    num_classes = dataset_spec(config.dataset).num_classes
    weights = get_weights(build_run_model(resolved, num_classes, get_method(config.method).conditioned))
    count = 0
    profiler = cProfile.Profile()
    start = time.perf_counter()
    for server_round in range(1, args.rounds + 1):
        for message_type, content in messages_for(weights, server_round):
            for context in contexts:
                message = Message(content, dst_node_id=context.node_id, message_type=message_type)
                profiler.enable()
                app(message, context)
                profiler.disable()
                count += 1
    elapsed = time.perf_counter() - start
    print(f"{count} messages in {elapsed:.2f} s: {1000 * elapsed / count:.1f} ms per message (machine may be busy)")
    pstats.Stats(profiler).sort_stats(args.sort).print_stats(args.filter, args.top)


if __name__ == "__main__":
    main()
