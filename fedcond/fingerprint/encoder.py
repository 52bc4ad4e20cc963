"""The frozen fingerprint encoder phi for RGB data: a small ResNet trained on data no client holds.

The paper embeds CIFAR images with a 128-d encoder trained on the other CIFAR (CIFAR-100 for
CIFAR-10 clients and vice versa). ``fingerprint-encoder`` names the dataset the encoder is trained
on; ``pixels`` (the default) uses flattened pixels instead. ``<dataset>-reserved`` (for example
``cifar10-reserved``) trains it on a fixed, class-stratified fifth of that dataset's training split
which the scenario then gives to no client: the paper's rule (no image the federation trains on)
kept without a second dataset, and each CIFAR-10 cluster of E1 K=2 left with the 20,000 training
images the paper's Rich setting uses (4,000 x 5). The encoder is trained once, by the first process
that needs it (the ServerApp, before any client), and its weights are cached in
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

from fedcond.data.datasets import DATASETS, load_dataset
from fedcond.errors import FedcondError
from fedcond.model.device import pick_device

EMBEDDING_DIM = 128
# A seeded subset of the source's training split keeps training to a few CPU minutes.
ENCODER_SETTINGS = {
    "samples": 10_000, "epochs": 2, "batch_size": 128, "learning_rate": 0.05, "momentum": 0.9, "seed": 0, "version": 1,
}  # fmt: skip
RESERVED_SUFFIX = "-reserved"
# A reserved encoder follows the paper's recipe for its CIFAR encoder (Adam, lr 0.001, batch 128,
# 50 epochs) on the reserved images: ~10,000 for CIFAR-10, 10-15 CPU minutes once, then cached.
RESERVED_SETTINGS = {"fraction": 0.2, "epochs": 50, "batch_size": 128, "learning_rate": 0.001, "seed": 0, "version": 1}


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


def reserved_source(source: str) -> str | None:
    """The dataset a ``<dataset>-reserved`` encoder holds back part of, else None."""
    return source.removesuffix(RESERVED_SUFFIX) if source.endswith(RESERVED_SUFFIX) else None


def check_encoder(source: str, client_datasets: tuple[str, ...]) -> None:
    """The encoder must come from a known dataset that no client of the run holds (a reserved
    encoder's images are held by no client by construction)."""
    if source == "pixels":
        return
    tabular = [name for name in client_datasets if DATASETS[name].tabular]
    if tabular:
        raise FedcondError(
            f"fingerprint-encoder '{source}' is an image encoder and {tabular[0]} is a tabular task, whose "
            "fingerprint reads its features as they are; set fingerprint-encoder=pixels"
        )
    dataset = reserved_source(source) or source
    images = [name for name, spec in DATASETS.items() if not spec.tabular]
    if dataset not in images:
        choices = ", ".join([*images, *(f"{name}{RESERVED_SUFFIX}" for name in images)])
        raise FedcondError(f"unknown fingerprint-encoder '{source}'; use pixels or one of {choices}")
    if source in client_datasets:
        raise FedcondError(
            f"fingerprint-encoder '{source}' would be trained on the clients' own dataset; "
            f"choose another source, or {source}{RESERVED_SUFFIX} (a part of it that no client gets)"
        )


def reserved_train_indices(train_labels: np.ndarray) -> np.ndarray:
    """The training images a reserved encoder learns from and no client holds: a seeded
    ``fraction`` of every class (the same for every run seed, so every run shares one encoder)."""
    rng = np.random.default_rng(RESERVED_SETTINGS["seed"])
    chosen = []
    for label in np.unique(train_labels):
        members = np.flatnonzero(train_labels == label)
        keep = round(len(members) * RESERVED_SETTINGS["fraction"])
        chosen.append(rng.permutation(members)[:keep])
    return np.sort(np.concatenate(chosen))


def _recipe(source: str) -> dict[str, float | int | str]:
    return RESERVED_SETTINGS if reserved_source(source) else ENCODER_SETTINGS


def _cache_path(source: str, data_dir: Path | None) -> Path:
    from fedcond.data.cifar import cache_dir

    key = json.dumps({"source": source, "data_dir": str(data_dir or ""), **_recipe(source)}, sort_keys=True)
    return cache_dir() / f"encoder-{source}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"


def train_encoder(source: str, data_dir: Path | None) -> Encoder:
    """Train the encoder for classification on ``source``'s training split (its test split unused):
    a seeded subset with SGD, or for a reserved encoder its reserved images with the paper's Adam."""
    reserved = reserved_source(source)
    dataset = load_dataset(reserved or source, data_dir)
    recipe = _recipe(source)
    generator = torch.Generator().manual_seed(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    model = Encoder(dataset.num_classes)
    if reserved:
        subset = reserved_train_indices(dataset.train_y)
        optimiser: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=recipe["learning_rate"])
    else:
        subset = np.random.default_rng(recipe["seed"]).permutation(len(dataset.train_y))
        subset = np.sort(subset[: recipe["samples"]])
        optimiser = torch.optim.SGD(model.parameters(), lr=recipe["learning_rate"], momentum=recipe["momentum"])
    images, labels = dataset.train_x[subset], torch.from_numpy(dataset.train_y[subset])
    batch = recipe["batch_size"]
    model.train()
    for _ in range(recipe["epochs"]):
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
    num_classes = DATASETS[reserved_source(source) or source].num_classes
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
    device = pick_device()  # the cached encoder is the CPU's; a GPU only embeds faster
    encoder = load_encoder(source, data_dir).to(device)
    rgb = as_rgb32(images)
    with torch.no_grad():
        parts = [
            encoder.embed(torch.from_numpy(rgb[i : i + 512]).to(device)).cpu().numpy() for i in range(0, len(rgb), 512)
        ]
    return np.concatenate(parts).astype(np.float64)
