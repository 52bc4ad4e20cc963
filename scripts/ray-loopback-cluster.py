"""A multi-node Ray cluster on one machine, every Ray socket on 127.0.0.1: to try a Ray-cluster simulation.

    .venv/bin/python scripts/ray-loopback-cluster.py [--nodes 2] [--cpus-per-node 1]

prints ``RAY_ADDRESS=127.0.0.1:<port>`` and keeps the cluster up until Ctrl+C or SIGTERM, then
stops every node. Why not ``ray start``: on Linux, ``ray start --node-ip-address=127.0.0.1``
replaces 127.0.0.1 by the machine's network address and binds every port on all interfaces;
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps it on loopback but then ``ray start --address``
refuses to add a second node. Ray's own test helper starts the nodes directly, on loopback.
On real machines use ``ray start`` as docs/deployment.md says.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

# Before Ray is imported: every node's address is 127.0.0.1 and every server binds there.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes, head included (default 2)")
    parser.add_argument("--cpus-per-node", type=int, default=1, help="CPUs each node offers (default 1)")
    arguments = parser.parse_args()

    import ray._common.utils
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": arguments.cpus_per_node, "include_dashboard": False}
    )
    # The helper records the cluster in /tmp/ray/ray_current_cluster, where every plain ray.init() on
    # this machine (other users' simulations too) would join it: forget it at once, RAY_ADDRESS only.
    ray._common.utils.reset_ray_address()
    try:
        for _ in range(arguments.nodes - 1):
            cluster.add_node(num_cpus=arguments.cpus_per_node)
        cluster.wait_for_nodes()
        print(f"RAY_ADDRESS={cluster.address}", flush=True)
        print(f"{arguments.nodes} nodes x {arguments.cpus_per_node} CPUs on 127.0.0.1; Ctrl+C stops them",
              file=sys.stderr, flush=True)  # fmt: skip
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
