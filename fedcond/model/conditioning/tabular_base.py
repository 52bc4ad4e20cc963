"""What lin and ens share on a tabular model: each builds the whole conditioned network over feature
vectors (``fedcond.model.networks.TabularModel``), where concat, film and hyper condition its MLP (ens on a
CNN conditions its head instead: ``fedcond.model.conditioning.ens``).

The unconditioned tabular model is a linear model (logistic regression on a classification task):
the model class of the appendix's references, Global, Cluster and Client; ``extra_parameters``
counts from it.
"""

from __future__ import annotations

from torch import nn

from fedcond.model.conditioning.base import Mechanism


class TabularMechanism(Mechanism):
    builds_own_model = True

    def plain_parameters(self, num_features: int, num_classes: int) -> int:
        """The unconditioned linear model's parameters, which ``extra_parameters`` counts from."""
        return num_features * num_classes + num_classes

    def add_modules(self, model: nn.Module, condition_dim: int, hidden: int, num_classes: int) -> None:
        raise NotImplementedError
