"""The fingerprint reconstruction attack, measured: what a curious server learns from one update.

    python benchmarks/fingerprint_attack.py                          # digits, the three conditionings
    python benchmarks/fingerprint_attack.py --dp-noise-multiplier 0,0.5,1,2 --fingerprint-epsilon 0,1,8
    python benchmarks/fingerprint_attack.py --dataset mnist --data-dir DIR --data-fraction 0.1

The server's view, simulated with fedcond's own code: every training client computes its raw
fingerprint, the federation publishes their mean and std (what the secure sum gives), and client 0
trains one round from the seeded initial model, plainly or with DP-SGD (``fedcond.model.training``); with
``--fingerprint-epsilon`` it trains on its DP fingerprint. ``fedcond.privacy.attack.reconstruct_condition``
then reads the fingerprint out of the update. Printed per setting (mean over ``--repeats``, since DP
noise differs every time): the cosine of the reconstruction with the client's true z-scored
fingerprint, the relative error of the raw eigenvalues it implies, and the cosine with what the model
was actually fed (the DP fingerprint, which the server is allowed to learn). ``--aggregate K`` also
attacks the sample-weighted average of K clients' updates (FedAvg's, or what secure aggregation
reveals) and reports the best cosine with any of the K clients.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from fedcond.config import RunConfig
from fedcond.data.client_data import ClientData, client_fingerprint, load_client_data
from fedcond.federation.methods import run_config
from fedcond.fingerprint import fingerprints as fp
from fedcond.model.networks import build_run_model, get_weights
from fedcond.model.training import DpSgd, TrainSettings, train, train_private
from fedcond.privacy.attack import cosine_similarity, reconstruct_condition, relative_error, undo_zscore
from fedcond.privacy.dp import PrivacyLedger, SampleLevelPrivacy, private_fingerprint


def numbers(text: str) -> list[float]:
    return [float(value) for value in text.split(",") if value]


def trained_update(
    config: RunConfig, data: ClientData, fed: np.ndarray, noise_multiplier: float, max_grad_norm: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(sent, returned) of one round of ``data``'s client fed ``fed``."""
    model = build_run_model(config, data.num_classes, conditioned=True)
    sent = get_weights(model)
    settings = TrainSettings.of(config)
    if noise_multiplier > 0:
        dp_sgd = DpSgd(noise_multiplier, max_grad_norm)
        train_private(model, data.train_x, data.train_y, fed, settings, dp_sgd, PrivacyLedger())
    else:
        train(model, data.train_x, data.train_y, fed, settings, seed=data.partition_id)
    return sent, get_weights(model)


def fed_fingerprints(
    config: RunConfig, clients: list[ClientData], raws: np.ndarray, fingerprint_epsilon: float, delta: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What each client feeds its model (z-scored, DP when asked), and the published mean and std."""
    released = raws
    if fingerprint_epsilon > 0:
        privacy = SampleLevelPrivacy(0.0, 1.0, delta, fingerprint_epsilon)
        released = np.array([
            private_fingerprint(
                raw, config.fingerprint, data.train_x, data.train_y, data.num_classes, config.fingerprint_dim, privacy
            ).vector
            for raw, data in zip(raws, clients, strict=True)
        ])  # fmt: skip
    mean, std = released.mean(axis=0), released.std(axis=0)
    return np.array([fp.standardise(vector, mean, std) for vector in released]), mean, std


def attack_once(
    config: RunConfig, clients: list[ClientData], raws: np.ndarray, noise: float, fingerprint_epsilon: float,
    args: argparse.Namespace,
) -> list[float]:  # fmt: skip
    """One measurement: [cos(true z), raw rel. error, cos(fed), (aggregate best cos), seconds]."""
    start = time.perf_counter()
    template = build_run_model(config, clients[0].num_classes, conditioned=True)
    truth = fp.standardise(raws[0], raws.mean(axis=0), raws.std(axis=0))
    fed, mean, std = fed_fingerprints(config, clients, raws, fingerprint_epsilon, args.dp_delta)
    sent, returned = trained_update(config, clients[0], fed[0], noise, args.dp_max_grad_norm)
    recovered = reconstruct_condition(template, sent, returned)
    row = [
        cosine_similarity(recovered, truth),
        relative_error(undo_zscore(recovered, mean, std), raws[0]),
        cosine_similarity(recovered, fed[0]),
    ]
    if args.aggregate:
        members = range(min(args.aggregate, len(clients)))
        updates = [trained_update(config, clients[k], fed[k], noise, args.dp_max_grad_norm)[1] for k in members]
        weights = np.array([len(clients[k].train_y) for k in members], dtype=np.float64)
        weights /= weights.sum()
        average = [np.tensordot(weights, np.stack(arrays), axes=1) for arrays in zip(*updates, strict=True)]
        mixed = reconstruct_condition(template, sent, average)
        row.append(max(cosine_similarity(mixed, fed[k]) for k in members))
    return [*row, time.perf_counter() - start]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--data-fraction", type=float, default=1.0)
    parser.add_argument("--conditioning", default="concat,film,hyper")
    parser.add_argument("--dp-noise-multiplier", default="0", help="comma-separated; 0 = plain SGD")
    parser.add_argument("--dp-max-grad-norm", type=float, default=1.0)
    parser.add_argument("--fingerprint-epsilon", default="0", help="comma-separated; 0 = exact fingerprint")
    parser.add_argument("--dp-delta", type=float, default=1e-5)
    parser.add_argument("--aggregate", type=int, default=0, help="also attack the average of this many clients")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    aggregate = " aggregate best cos |" if args.aggregate else ""
    print(f"| conditioning | dp-noise-multiplier | fingerprint-epsilon | cos(true z) | raw rel. error | cos(fed) |"
          f"{aggregate} s/attack |")  # fmt: skip
    print(f"|---|---|---|---|---|---|{'---|' if args.aggregate else ''}---|")
    for conditioning in args.conditioning.split(","):
        config = run_config({
            "dataset": args.dataset, "data-dir": args.data_dir, "data-fraction": args.data_fraction,
            "conditioning": conditioning,
        }).resolved()  # fmt: skip
        clients = [load_client_data(config, partition) for partition in range(config.num_training_clients)]
        raws = np.array([client_fingerprint(config, data) for data in clients])
        for epsilon in numbers(args.fingerprint_epsilon):
            for noise in numbers(args.dp_noise_multiplier):
                rows = [attack_once(config, clients, raws, noise, epsilon, args) for _ in range(args.repeats)]
                cells = " | ".join(f"{value:.3g}" for value in np.mean(rows, axis=0))
                print(f"| {conditioning} | {noise:g} | {epsilon:g} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
