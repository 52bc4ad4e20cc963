"""Named variants: a method name that stands for another method with some settings fixed
(``method=recommended`` is ``conditional`` with ``fingerprint=class-mean``, ``conditioning=hyper``,
``condition-scale=unit`` and ``hyper-init=zero``).

A variant is settings, not code: the server's method table lists it beside its base method, and a
ClientApp applies its settings and builds its base method's client (``client_path``), both from
this one table, which knows no Flower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedcond.config import RunConfig
from fedcond.errors import FedcondError


@dataclass(frozen=True)
class Variant:
    base: str
    summary: str
    settings: tuple[tuple[str, Any], ...]


#: Never the default and never swapped in silently. One name: `recommended` is the conditioned setting
#: the like-for-like selection chose on validation accuracy over MNIST E1 K=5, MNIST E1 K=2 x 50,
#: CIFAR-10 E2a and E4b (docs/comparisons.md; `python -m tools.select_recommended
#: experiments/results/like-for-like`). The server optimiser it was chosen with (FedAvgM 0.5) is not
#: part of it: it is a setting of every averaging arm of a comparison, given to all of them alike. The
#: settings it did not choose (the paper-era class-mean + hyper head, the ridge head fit) stay
#: documented ablations, run by their settings (docs/instability.md).
VARIANTS = {
    "recommended": Variant(
        "conditional",
        "conditional with a label-aware fingerprint, read at 1/sqrt(d), generating the output layer from zero",
        (("fingerprint", "class-mean"), ("conditioning", "hyper"), ("condition-scale", "unit"), ("hyper-init", "zero")),
    ),
}


#: Names that were variants before the selection chose one, and the settings that run each now: a
#: command written for one is refused with the run that replaces it, not with the list of methods.
RETIRED = {
    "scaled-hyper": "method=recommended",
    "scaled-hyper-momentum": "method=recommended server-momentum=0.5",
    "scaled-hyper-ridge": "method=recommended server-momentum=0.5 head-fit=ridge",
}


def base_method(name: str) -> str:
    """The method a name runs: its base for a variant, else the name itself."""
    variant = VARIANTS.get(name)
    return variant.base if variant else name


def client_path(name: str) -> str:
    """Where a federated method's client class is found by its name (as FL-bench finds a method's
    files): ``Client`` in ``clients/<method>.py``, the base method's for a variant."""
    return f"fedcond.clients.{base_method(name).replace('-', '_')}:Client"


def with_variant_settings(
    mapping: Mapping[str, Any],
    explicit: Mapping[str, Any] | None = None,
    option_defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``mapping`` with the settings its method fixes, if it names a variant (``method=recommended``).

    A setting the user gave (``explicit``) with another value is refused: the run would not be the
    variant its name says. Where only the merged run config is known (Flower's, which holds every
    key), a setting at its default takes the variant's value and any other value is refused.
    """
    name = str(mapping.get("method", RunConfig.method))
    variant = VARIANTS.get(name)
    if variant is None:
        return dict(mapping)
    # A variant may fix a method's own setting (an Option): the caller that knows the options' defaults
    # (the server's method table) checks it; a ClientApp, which knows only its own, takes it as fixed.
    defaults = {**RunConfig().to_mapping(), **(option_defaults or {})}
    for key, value in variant.settings:
        given = mapping.get(key, value)
        if key not in defaults:
            continue
        allowed = (value,) if explicit is not None and key in explicit else (value, defaults[key])
        if given not in allowed:
            raise FedcondError(
                f"method={name} is {variant.base} with {key}={value}; drop {key}={given}, "
                f"or use method={variant.base} to choose {key} yourself"
            )
    return {**mapping, **dict(variant.settings)}
