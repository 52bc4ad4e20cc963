"""Samples per second of the paper's CNNs, one SGD step at a time, and what PyTorch's CPU options change.

    python benchmarks/training_step.py [--threads 2] [--steps 30] [--compile]

For the MNIST CNN (1x28x28, 10 classes) and the CIFAR CNN (3x32x32, batch norm) at batch 64:
training steps (forward, backward, SGD with momentum) and evaluation batches (no_grad vs
inference_mode), each plain and channels-last; with ``--compile`` also ``torch.compile`` (needs a
C++ compiler; its compile time is reported apart). Every variant starts from the same weights and
batches; the "max |diff|" column is the largest weight difference after the steps from the plain
variant (0: bit-identical, so numerically faithful).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from fedcond.model.networks import build_model

BATCH = 64
NETWORKS = {"mnist": ((1, 28, 28), 10), "cifar": ((3, 32, 32), 10)}


def batches(shape: tuple[int, int, int], count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.rand((BATCH, *shape), generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
        for _ in range(count)
    ]


def train_steps(model: nn.Module, data: list, channels_last: bool, step: Callable | None = None) -> float:
    """Seconds for one SGD step per batch (after one untimed warm-up step on the first batch)."""
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    forward = model if step is None else step  # (a compiled module has no truth value)
    model.train()

    def one(x: torch.Tensor, y: torch.Tensor) -> None:
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        optimiser.zero_grad()
        loss = criterion(forward(x), y)
        loss.backward()
        optimiser.step()

    one(*data[0])  # warm-up (and, compiled, the compilation), then the timed steps
    start = time.perf_counter()
    for x, y in data[1:]:
        one(x, y)
    return time.perf_counter() - start


def eval_batches(model: nn.Module, data: list, mode: Callable, channels_last: bool) -> float:
    model.eval()
    start = time.perf_counter()
    with mode():
        for x, _ in data:
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            model(x).argmax(dim=1)
    return time.perf_counter() - start


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((p - q).abs().max()) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def line(network: str, variant: str, samples_per_second: float, difference: float | None = None) -> None:
    shown = "" if difference is None else f"{difference:11.2g}"
    print(f"{network:8} {variant:32} {samples_per_second:10.0f} {shown}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="timed training steps per variant")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many, variants interleaved")
    parser.add_argument("--compile", action="store_true", help="also try torch.compile (slow to compile)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, batch {BATCH}, best of {args.repeats}")
    print(f"{'network':8} {'variant':32} {'samples/s':>10} {'max |diff|':>11}")
    for name, (shape, classes) in NETWORKS.items():
        data = batches(shape, args.steps + 1)
        fastest: dict[str, float] = {}
        differences: dict[str, float] = {}
        compiled_model = None
        for _ in range(args.repeats):  # interleaved, so that a busy spell hurts every variant alike
            reference = build_model(shape, classes, 0, seed=0)
            runs = {"train plain": (reference, False, None)}
            last = build_model(shape, classes, 0, seed=0).to(memory_format=torch.channels_last)
            runs["train channels-last"] = (last, True, None)
            if args.compile:
                model = build_model(shape, classes, 0, seed=0)
                try:
                    start = time.perf_counter()
                    compiled_model = torch.compile(model)
                    train_steps(model, data[:2], channels_last=False, step=compiled_model)  # compiles
                    print(f"{name:8} torch.compile: compiled in {time.perf_counter() - start:.0f} s", flush=True)
                    model = build_model(shape, classes, 0, seed=0)
                    runs["train torch.compile"] = (model, False, torch.compile(model))
                except Exception as error:  # a missing compiler or backend: report it, go on
                    print(f"{name:8} torch.compile failed: {type(error).__name__}: {str(error)[:300]}")
                    args.compile = False
            for variant, (model, channels_last, step) in runs.items():
                seconds = train_steps(model, data, channels_last, step)
                fastest[variant] = max(fastest.get(variant, 0.0), BATCH * args.steps / seconds)
                differences[variant] = max_difference(reference, model)
            for label, mode in (("eval no_grad", torch.no_grad), ("eval inference_mode", torch.inference_mode)):
                for channels_last in (False, True):
                    model = build_model(shape, classes, 0, seed=0)
                    if channels_last:
                        model = model.to(memory_format=torch.channels_last)
                    seconds = eval_batches(model, data, mode, channels_last)
                    variant = label + (" channels-last" if channels_last else "")
                    fastest[variant] = max(fastest.get(variant, 0.0), BATCH * len(data) / seconds)
        for variant, rate in fastest.items():
            line(name, variant, rate, differences.get(variant))


if __name__ == "__main__":
    main()
