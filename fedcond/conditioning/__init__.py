"""Conditioning mechanisms: how the shared model takes a client's fingerprint s.

One module per mechanism (as peft keeps one per adapter), each defining ``MECHANISM``, and one line
each in ``MECHANISMS``. A mechanism says how many fingerprint inputs the first FC layer takes, which
modules of its own it adds to the network (built after the backbone, so that the backbone's seeded
weights never depend on the mechanism), how the logits come out of the features and s, where the
fingerprint shows in a model update (the reconstruction attack, ``fedcond.attack``) and how Opacus
gets per-sample gradients of its own layers (``fedcond.privacy``). Modules are imported when first
asked for, so that checking a setting imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fedcond.errors import FedcondError

if TYPE_CHECKING:
    from fedcond.conditioning.base import Mechanism

# The one table of conditioning mechanisms: name -> its module (docs/fingerprints.md compares them).
MECHANISMS = {
    "concat": "fedcond.conditioning.concat",
    "film": "fedcond.conditioning.film",
    "hyper": "fedcond.conditioning.hyper",
}


def check_conditioning(name: str) -> None:
    if name not in MECHANISMS:
        raise FedcondError(f"unknown conditioning '{name}'; choose one of {', '.join(MECHANISMS)}")


def mechanism(name: str) -> Mechanism:
    """The mechanism ``name`` (its module imported now)."""
    check_conditioning(name)
    return importlib.import_module(MECHANISMS[name]).MECHANISM
