"""The frozen fingerprint encoder phi for RGB data: a small ResNet trained on data no client holds.

The paper embeds CIFAR images with a 128-d encoder trained on the other CIFAR (CIFAR-100 for
CIFAR-10 clients and vice versa). ``fingerprint-encoder`` names the dataset the encoder is trained
on; ``pixels`` (the default) uses flattened pixels instead. The encoder is trained once, by the
first process that needs it (the ServerApp, before any client), and its weights are cached in
``$FEDCOND_CACHE_DIR`` keyed by everything that shapes them.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedcond.datasets import DATASETS, load_dataset
from fedcond.errors import FedcondError

EMBEDDING_DIM = 128
# A seeded subset of the source's training split keeps training to a few CPU minutes.
ENCODER_SETTINGS = {
    "samples": 10_000, "epochs": 2, "batch_size": 128, "learning_rate": 0.05, "momentum": 0.9, "seed": 0, "version": 1,
}  # fmt: skip


class ResidualBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride=2, bias=False), nn.BatchNorm2d(out_channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Encoder(nn.Module):
    """Stem conv (32) -> residual stage 64 -> residual stage 128 -> global average pool: 128-d."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.embed = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            ResidualBlock(32, 64), ResidualBlock(64, EMBEDDING_DIM),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(EMBEDDING_DIM, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(images))


def as_rgb32(images: np.ndarray) -> np.ndarray:
    """Any of fedcond's images as 3x32x32: grey is repeated over channels, 28x28 padded by 2."""
    if images.shape[1] == 1:
        images = np.repeat(images, 3, axis=1)
    pad = (32 - images.shape[2]) // 2
    if pad > 0:
        images = np.pad(images, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    if images.shape[1:] != (3, 32, 32):
        raise FedcondError(f"the fingerprint encoder takes 32x32 images, got {images.shape[2:]}")
    return np.ascontiguousarray(images, dtype=np.float32)


def check_encoder(source: str, client_datasets: tuple[str, ...]) -> None:
    """The encoder must come from a known dataset that no client of the run holds."""
    if source == "pixels":
        return
    if source not in DATASETS:
        raise FedcondError(f"unknown fingerprint-encoder '{source}'; use pixels or one of {', '.join(DATASETS)}")
    if source in client_datasets:
        raise FedcondError(
            f"fingerprint-encoder '{source}' would be trained on the clients' own dataset; choose another source"
        )


def _cache_path(source: str, data_dir: Path | None) -> Path:
    from fedcond.cifar import cache_dir

    key = json.dumps({"source": source, "data_dir": str(data_dir or ""), **ENCODER_SETTINGS}, sort_keys=True)
    return cache_dir() / f"encoder-{source}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"


def train_encoder(source: str, data_dir: Path | None) -> Encoder:
    """Train the encoder for classification on ``source``'s training split (its test split unused)."""
    dataset = load_dataset(source, data_dir)
    generator = torch.Generator().manual_seed(ENCODER_SETTINGS["seed"])
    torch.manual_seed(ENCODER_SETTINGS["seed"])
    model = Encoder(dataset.num_classes)
    optimiser = torch.optim.SGD(
        model.parameters(), lr=ENCODER_SETTINGS["learning_rate"], momentum=ENCODER_SETTINGS["momentum"]
    )
    subset = np.random.default_rng(ENCODER_SETTINGS["seed"]).permutation(len(dataset.train_y))
    subset = np.sort(subset[: ENCODER_SETTINGS["samples"]])
    images, labels = dataset.train_x[subset], torch.from_numpy(dataset.train_y[subset])
    batch = ENCODER_SETTINGS["batch_size"]
    model.train()
    for _ in range(ENCODER_SETTINGS["epochs"]):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(order), batch):
            chosen = order[start : start + batch].numpy()
            optimiser.zero_grad()
            loss = nn.functional.cross_entropy(model(torch.from_numpy(as_rgb32(images[chosen]))), labels[chosen])
            loss.backward()
            optimiser.step()
    return model.eval()


@functools.lru_cache(maxsize=2)
def load_encoder(source: str, data_dir: Path | None) -> Encoder:
    """The trained encoder, from the cache or trained now (and cached for every later process)."""
    path = _cache_path(source, data_dir)
    num_classes = DATASETS[source].num_classes
    if path.is_file():
        model = Encoder(num_classes)
        try:
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            return model.eval()
        except (RuntimeError, OSError, EOFError):
            path.unlink(missing_ok=True)  # a cut-short cache file: train again
    model = train_encoder(source, data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(model.state_dict(), partial)
    partial.replace(path)
    return model


def embed(images: np.ndarray, source: str, data_dir: Path | None) -> np.ndarray:
    """phi(x): the frozen encoder's 128-d embedding of every image."""
    encoder = load_encoder(source, data_dir)
    rgb = as_rgb32(images)
    with torch.no_grad():
        parts = [encoder.embed(torch.from_numpy(rgb[i : i + 512])).numpy() for i in range(0, len(rgb), 512)]
    return np.concatenate(parts).astype(np.float64)
