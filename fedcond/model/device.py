"""Where torch computes: CUDA when present, else the CPU (every training, evaluation and embedding)."""

from __future__ import annotations

import torch


def pick_device() -> torch.device:
    """CUDA when present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
