"""Talking to the whole federation before round 1: check its size, ask every client a question, and
run the secure sum of fingerprint statistics for federated normalisation."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from flwr.common import Code, GetPropertiesIns
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from fedcond import fingerprint as fp
from fedcond import secure_sum
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.messages import (
    ERROR,
    PUBLIC_KEY,
    PUBLIC_KEYS,
    SESSION,
    SHARE,
    STEP,
    STEP_KEYS,
    STEP_SHARE,
    UINT64,
    array_from_bytes,
)


def all_clients(client_manager: ClientManager, config: RunConfig) -> list[ClientProxy]:
    """Every node, after checking there is exactly one per client of the scenario (held-out ones included)."""
    expected = config.num_clients
    client_manager.wait_for(expected, timeout=config.node_timeout)
    found = client_manager.num_available()
    if found != expected:
        held_out = f" + {config.held_out_clients} held-out" if config.held_out_clients else ""
        raise FedcondError(
            f"the federation has {found} nodes but num-clusters x (clients-per-cluster{held_out}) = "
            f"{config.num_clusters} x {config.clients_per_cluster + config.held_out_clients} = {expected} "
            f"(waited {config.node_timeout} s); run with "
            f'--federation-config "num-supernodes={expected}" or change clients-per-cluster'
        )
    return list(client_manager.all().values())


def ask_all(proxies: list[ClientProxy], config: dict[str, object]) -> list[dict[str, object]]:
    def ask(proxy: ClientProxy) -> dict[str, object]:
        response = proxy.get_properties(GetPropertiesIns(config=config), timeout=None, group_id=0)
        if response.status.code != Code.OK:
            raise FedcondError(f"a client failed to answer before round 1: {response.status.message}")
        if ERROR in response.properties:
            raise FedcondError(f"a client failed to answer before round 1: {response.properties[ERROR]}")
        return response.properties

    with ThreadPoolExecutor(max_workers=min(len(proxies), 16)) as pool:
        return list(pool.map(ask, proxies))


def federated_fingerprint_statistics(proxies: list[ClientProxy], dim: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Mean and std of the clients' raw fingerprints, from a secure sum of (f, f^2, 1).

    The server learns the sum of fingerprints, the sum of their squares and the number of clients,
    nothing per client. Returns (mean, std, bytes exchanged).
    """
    keys = ask_all(proxies, {STEP: STEP_KEYS})
    packed = secure_sum.pack_keys([answer[PUBLIC_KEY] for answer in keys])
    session = os.urandom(16)
    answers = ask_all(proxies, {STEP: STEP_SHARE, PUBLIC_KEYS: packed, SESSION: session})
    shares = [array_from_bytes(answer[SHARE], SHARE, UINT64) for answer in answers]
    total = secure_sum.open_sum(shares)
    if len(total) != 2 * dim + 1:
        raise FedcondError(f"secure sum returned {len(total)} values, expected {2 * dim + 1}; fingerprint-dim differs")
    mean, std = fp.mean_and_std(total[:dim], total[dim : 2 * dim], round(total[-1]))
    exchanged = len(proxies) * (secure_sum.KEY_BYTES + len(packed) + len(session) + 8 * len(total))
    return mean, std, exchanged
