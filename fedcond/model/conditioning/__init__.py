"""Conditioning mechanisms: how the shared model takes a client's fingerprint s.

One module per mechanism (as peft keeps one per adapter), each defining ``MECHANISM``, and one line
each in ``MECHANISMS``. A mechanism says how many fingerprint inputs the first FC layer takes, which
modules of its own it adds to the network (built after the backbone, so that the backbone's seeded
weights never depend on the mechanism), how the logits come out of the features and s, where the
fingerprint shows in a model update (the reconstruction attack, ``fedcond.privacy.attack``) and how Opacus
gets per-sample gradients of its own layers (``fedcond.privacy.dp``). Modules are imported when first
asked for, so that checking a setting imports no torch.
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING

from fedcond.errors import FedcondError

if TYPE_CHECKING:
    from fedcond.model.conditioning.base import Mechanism

# The one table of conditioning mechanisms: name -> its module and the models it conditions ("cnn":
# images, ``fedcond.model.networks.ConditionalCNN``; "tabular": ``fedcond.model.networks.TabularModel``), here and not
# in the modules so that checking a setting imports none of them (docs/fingerprints.md compares them).
MECHANISMS: dict[str, tuple[str, frozenset[str]]] = {
    # On a tabular model these three condition an MLP, features -> FC hidden -> ReLU -> FC outputs:
    # concat there is the appendix's "MLP", the fingerprint concatenated to the features.
    "concat": ("fedcond.model.conditioning.concat", frozenset({"cnn", "tabular"})),
    "film": ("fedcond.model.conditioning.film", frozenset({"cnn", "tabular"})),
    "hyper": ("fedcond.model.conditioning.hyper", frozenset({"cnn", "tabular"})),
    "lin": ("fedcond.model.conditioning.lin", frozenset({"tabular"})),
    "ens": ("fedcond.model.conditioning.ens", frozenset({"cnn", "tabular"})),  # on a CNN: a mixture of heads
}


#: ``hyper-init``: how the generated head starts (``fedcond.model.conditioning.hyper``).
HYPER_INITS = ("random", "zero")
#: ``condition-scale``'s words; any positive number is accepted too.
CONDITION_SCALES = ("none", "unit")


def condition_scale_factor(setting: str, condition_dim: int) -> float:
    """The factor ``condition-scale`` puts on a ``condition_dim``-long fingerprint where the model reads it:
    ``none`` 1, ``unit`` 1/sqrt(d) (a z-scored fingerprint has squared norm about d), else the number."""
    if setting == "none" or not condition_dim:
        return 1.0
    if setting == "unit":
        return 1.0 / math.sqrt(condition_dim)
    return float(setting)


def check_condition_scale(setting: str) -> None:
    if setting in CONDITION_SCALES:
        return
    try:
        value = float(setting)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise FedcondError(f"condition-scale must be none, unit or a positive number (got {setting!r})")


def check_conditioning(name: str) -> None:
    if name not in MECHANISMS:
        raise FedcondError(f"unknown conditioning '{name}'; choose one of {', '.join(MECHANISMS)}")


def conditions(name: str, model_kind: str) -> bool:
    """Whether mechanism ``name`` conditions a ``model_kind`` model ("cnn" or "tabular")."""
    check_conditioning(name)
    return model_kind in MECHANISMS[name][1]


def check_conditioning_for(name: str, model_kind: str, dataset: str) -> None:
    """Mechanism ``name`` on a ``model_kind`` model: refused in one line where it is not offered."""
    if not conditions(name, model_kind):
        offered = ", ".join(key for key in MECHANISMS if conditions(key, model_kind))
        raise FedcondError(
            f"conditioning={name} is not offered for the {model_kind} model of {dataset}; choose one of {offered}"
        )


def mechanism(name: str) -> Mechanism:
    """The mechanism ``name`` (its module imported now)."""
    check_conditioning(name)
    return importlib.import_module(MECHANISMS[name][0]).MECHANISM
