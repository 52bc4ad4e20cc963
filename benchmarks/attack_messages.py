"""The fingerprint attack against the messages a conditioned method really sends, in four views.

    python benchmarks/attack_messages.py                  # the like-for-like candidates, digits
    python benchmarks/attack_messages.py --grid experiments/grids/like-for-like.toml --noise 0.1,1

Where ``fingerprint_attack.py`` trains one client with the training loop alone, this runs the
method's own round 1 in this process: the ServerApp's strategy sets the federation up (the
fingerprint statistics' sum, the published mean and standard deviation), sends its round-1 training
instruction, and every training client's real ClientApp client answers it (``InProcessNode``), so a
method's reply is attacked as it travels: the model with its conditioned layer, or with
``head-fit=ridge`` the head fit's products. Each client's fingerprint as its model reads it (what
``ConditionalClient.condition`` feeds) is the truth a reconstruction is scored against (cosine,
which no scaling changes). The views:

- **plain**: one client's reply, as the server receives it; the cosine is the mean over the
  training clients, each attacked alone (``fedcond.privacy.attack``: the model's linear blocks, or
  row 0 of a ridge reply's s~ s~^T, which is [1, c]).
- **secaggplus**: what SecAgg+ leaves the server, the sample-weighted mean of the replies (SecAgg+
  sums exactly that, up to its quantisation: ``tests/test_head_fit.py``, ``tests/test_privacy.py``);
  the cosine is the best with any one client.
- **client-dp (server)**: under ``client-dp=client-side`` the server receives each update clipped to
  ``--clip``: mean cosine over clients, each attacked alone.
- **client-dp (published), z**: what everyone the global model reaches sees under client-level DP:
  the mean of the clipped updates plus Flower's noise of std z x clip / clients (``--repeats`` draws);
  the cosine is the best with any one client, mean over draws.
- **chance, z**: the same attack on the noise alone (no client's update in it): the best cosine a
  guess reaches with one of this many fingerprints; a published cell near it recovers nothing. One
  row per reader: the model's linear blocks, and row 0 of a ridge reply's Gram matrix.

A ridge reply is a change from its instruction (the sent generator and a zero Gram matrix) like a
model update, so client-level DP clips and noises it as one (``fedcond/model/head_fit.py``). One round
from the seeded initial model, on the settings' dataset.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.common import FitIns, parameters_to_ndarrays
from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_clip_model_update, compute_stdv

from fedcond.data.datasets import dataset_spec
from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.client import FedcondClient
from fedcond.federation.client_app import client_class, node_data
from fedcond.federation.methods import run_config
from fedcond.federation.server_app import served_run
from fedcond.model import head_fit
from fedcond.model.aggregation import weighted_average
from fedcond.model.networks import build_run_model
from fedcond.privacy.attack import cosine_similarity, reconstruct_condition
from fedcond.tools.in_process import InProcessNode, plain_sum

Model = list[np.ndarray]


@dataclass(frozen=True)
class RoundOne:
    """What round 1 of some settings sent and received."""

    sent: Model
    #: Each training client's reply, its training samples and the fingerprint its model reads.
    replies: list[Model]
    samples: list[int]
    conditions: list[np.ndarray]
    #: Whether the replies carry head-fit products (``head-fit=ridge``), read at the Gram matrix.
    ridge: bool


def round_one(settings: dict[str, object]) -> RoundOne:
    """Round 1 of ``settings`` in this process, its results in a folder that goes with it."""
    with tempfile.TemporaryDirectory() as results_dir:
        return _round_one(settings, results_dir)


def _round_one(settings: dict[str, object], results_dir: str) -> RoundOne:
    config = run_config({**settings, "results-dir": results_dir, "verbose": False, "num-server-rounds": 1})
    check_run(config)
    resolved = config.resolved()
    ridge = head_fit.fits_by_ridge(resolved)
    with served_run(config, None) as (server, strategy, _):
        strategy.secure_rounds.sum = plain_sum  # type: ignore[method-assign]
        strategy.fold_fit_replies = False  # each reply as it travels, not folded into the round's mean
        manager = server.client_manager()
        for partition in range(resolved.num_clients):
            manager.register(InProcessNode(resolved, partition, Counter()))
        sent_parameters = strategy.initialize_parameters(manager)
        instructions = strategy.configure_fit(1, sent_parameters, manager)
        sent = parameters_to_ndarrays(instructions[0][1].parameters)
        replies, samples, conditions = [], [], []
        for proxy, instruction in instructions:
            reply = proxy.fit(FitIns(instruction.parameters, instruction.config), None, None)
            replies.append(parameters_to_ndarrays(reply.parameters))
            samples.append(reply.num_examples)
            node = InProcessNode(resolved, proxy.partition_id, Counter())  # type: ignore[attr-defined]
            client: FedcondClient = client_class(resolved.method)(
                resolved, node_data(node.context, resolved, proxy.partition_id), node.context
            )
            conditions.append(np.asarray(client.condition(instruction.config), dtype=np.float64))  # type: ignore[attr-defined]
    return RoundOne(sent, replies, samples, conditions, ridge)


def template_of(settings: dict[str, object]) -> torch.nn.Module:
    """A model of the settings' structure: all the attack reads of it."""
    config = run_config(settings).resolved()
    return build_run_model(config, dataset_spec(config.dataset).num_classes, conditioned=True)


def recovered(template: torch.nn.Module, sent: Model, reply: Model, ridge: bool) -> np.ndarray:
    """What the server reads out of one reply (or a mean of replies): the linear blocks' least
    squares, or row 0 of a ridge reply's s~ s~^T (the fingerprint after the head's 1)."""
    if ridge:
        gram = reply[-1]
        return np.asarray(gram[0, 1:], dtype=np.float64) / float(gram[0, 0])
    return reconstruct_condition(template, sent, reply)  # type: ignore[arg-type]


def clipped(sent: Model, reply: Model, clip: float) -> Model:
    """The reply as Flower's ``fixedclipping_mod`` sends it: sent + the update clipped to ``clip``."""
    returned = [np.asarray(array, dtype=np.float64).copy() for array in reply]
    compute_clip_model_update(returned, [np.asarray(array, dtype=np.float64) for array in sent], clip)
    return returned


def views(
    settings: dict[str, object], round_: RoundOne, clip: float, noises: Sequence[float], repeats: int
) -> list[str]:
    """One table row of cells for ``settings``, whose round 1 is ``round_``."""
    sent, replies, samples, conditions, ridge = (
        round_.sent, round_.replies, round_.samples, round_.conditions, round_.ridge
    )  # fmt: skip
    template = template_of(settings)
    alone = [cosine_similarity(recovered(template, sent, reply, ridge), truth)
             for reply, truth in zip(replies, conditions, strict=True)]  # fmt: skip
    mean = weighted_average(replies, samples)  # what SecAgg+ leaves the server, as the strategy averages
    secure = max(cosine_similarity(recovered(template, sent, mean, ridge), truth) for truth in conditions)
    cells = [f"{np.mean(alone):.3f}", f"{secure:.3f}"]
    clips = [clipped(sent, reply, clip) for reply in replies]
    dp_alone = [cosine_similarity(recovered(template, sent, reply, ridge), truth)
                for reply, truth in zip(clips, conditions, strict=True)]  # fmt: skip
    cells.append(f"{np.mean(dp_alone):.3f}")
    uniform = weighted_average(clips, [1.0] * len(clips))  # client-dp averages uniformly
    return [*cells, *(published(template, round_, uniform, noise, clip, repeats) for noise in noises)]


def published(template: torch.nn.Module, round_: RoundOne, mean: Model, noise: float, clip: float, repeats: int) -> str:
    """The attack on ``mean`` plus Flower's noise (std noise x clip / clients): its best cosine with
    any one of ``round_``'s clients, mean over ``repeats`` draws."""
    best = []
    for _ in range(repeats):
        model = [np.asarray(array, dtype=np.float64).copy() for array in mean]
        add_gaussian_noise_inplace(model, compute_stdv(noise, clip, len(round_.conditions)))
        guess = recovered(template, round_.sent, model, round_.ridge)
        best.append(max(cosine_similarity(guess, truth) for truth in round_.conditions))
    return f"{np.mean(best):.3f}"


def chance(
    settings: dict[str, object], round_: RoundOne, noises: Sequence[float], clip: float, repeats: int
) -> list[str]:
    """The attack on Flower's noise alone, as ``views`` scores a published model (one cell per noise):
    the noise added to the model ``round_`` sent, scored against its clients' fingerprints."""
    template = template_of(settings)
    return [published(template, round_, round_.sent, noise, clip, repeats) for noise in noises]


def candidates(grid: Path) -> list[tuple[str, dict[str, object]]]:
    """The grid's method bundles (label, settings): the like-for-like candidates by default."""
    bundles = tomllib.loads(grid.read_text())["grid"]["method"]
    return [(bundle["label"], {key: value for key, value in bundle.items() if key != "label"}) for bundle in bundles]


def setting_value(text: str) -> object:
    """A command-line value as TOML reads it (0.2 a float, 3 an int), else the text."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", type=Path, default=Path("experiments/grids/like-for-like.toml"))
    parser.add_argument("--setting", action="append", default=[], help="key=value for every run (repeatable)")
    parser.add_argument("--clip", type=float, default=1.0, help="client-dp-clipping-norm")
    parser.add_argument("--noise", default="0.1,1", help="client-dp-noise-multiplier values, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seeds the noise draws (numpy's global generator)")
    args = parser.parse_args()
    # Flower draws its noise from numpy's global generator: seeded here, the table can be drawn again.
    # (A deployment never seeds it: whoever held the seed could subtract the noise.)
    np.random.seed(args.seed)
    common = {key: setting_value(value) for key, value in (pair.split("=", 1) for pair in args.setting)}
    noises = [float(value) for value in args.noise.split(",") if value]
    header = ["candidate", "plain (one client)", "secaggplus (the mean)", f"client-dp (server, clip {args.clip:g})",
              *[f"client-dp (published, z={noise:g})" for noise in noises], "s"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    paper = {"method": "conditional", **common}
    # The first round read by each reader (False: the model's linear blocks; True: a ridge reply's Gram).
    first: dict[bool, tuple[dict[str, object], RoundOne]] = {}
    for label, settings in [("conditional (the paper's)", paper), *candidates(args.grid)]:
        start = time.perf_counter()
        settings = {**settings, **common}
        try:
            round_ = round_one(settings)
            cells = views(settings, round_, args.clip, noises, args.repeats)
        except FedcondError as error:
            round_, cells = None, [f"refused: {error}"] + [""] * (2 + len(noises))
        if round_ is not None:
            first.setdefault(round_.ridge, (settings, round_))
        print(f"| {label} | " + " | ".join(cells) + f" | {time.perf_counter() - start:.0f} |", flush=True)
    if not first:
        raise SystemExit("every method was refused with these settings: no round to draw chance from")
    for ridge, (settings, round_) in sorted(first.items()):
        noise_alone = chance(settings, round_, noises, args.clip, args.repeats)
        reader = "a ridge reply's Gram row 0" if ridge else "the model's linear blocks"
        print(f"| chance: the attack on the noise alone ({reader}) | | | | " + " | ".join(noise_alone) + " | |")


if __name__ == "__main__":
    main()
