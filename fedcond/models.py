"""The models: backbone CNNs for images and linear models for tabular tasks, optionally conditioned on
the client fingerprint.

How the fingerprint enters is a conditioning mechanism (``conditioning``), one module each in
``fedcond/conditioning`` (concat, the paper's; film; hyper), all on the same conv stack and FC
hidden layer. With ``condition_dim=0`` the network is the plain backbone every baseline uses. The
mechanisms are not the same size: on 28x28 images with a 32-d fingerprint, ``concat`` adds 4,096
parameters to the backbone's 421,642 (425,738 in all, the paper's count) and ``hyper`` adds 38,700
for a 30-d ``class-mean`` fingerprint (460,342, +8% over concat); on 8x8 digits the backbone has
53,002 and ``hyper`` 91,702 (+73%). ``hidden_units`` widens the FC hidden layer, for controls of
equal size.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedcond.conditioning import check_conditioning_for, mechanism
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.fingerprint import fingerprint_size, phi_features


def small_features(channels: int) -> nn.Sequential:
    """Conv(c,32,3)-ReLU-Pool-Conv(32,64,3)-ReLU-Pool: the paper's MNIST stack (also used for 8x8 digits)."""
    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )


def _conv_bn(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.BatchNorm2d(out_channels), nn.ReLU()]


def cifar_features(channels: int) -> nn.Sequential:
    """The paper's CIFAR stack: 2x Conv32 + Pool + 2x Conv64 + Pool, with batch norm (4096 features at 32x32)."""
    return nn.Sequential(
        *_conv_bn(channels, 32), *_conv_bn(32, 32), nn.MaxPool2d(2),
        *_conv_bn(32, 64), *_conv_bn(64, 64), nn.MaxPool2d(2),
        nn.Flatten(),
    )  # fmt: skip


def conditioned_logits(model: nn.Module, features: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
    """A conditioned network's outputs from its features and the client's fingerprint, one row (1, d)
    broadcast to every sample or one per sample, as its mechanism computes them."""
    if condition is None:
        raise ValueError("a conditioned model needs its client's fingerprint")
    return model.mechanism.logits(model, features, condition.expand(len(features), -1))


class ConditionalCNN(nn.Module):
    """A conv feature stack, then FC hidden -> ReLU -> FC classes, conditioned as ``conditioning`` says.

    On 28x28 inputs this is the paper's MNIST network (3136 conv features, FC 128): 425,738
    parameters with ``concat`` of a 32-d fingerprint and 10 classes; on 8x8 digits the small variant
    (256 features); on 32x32 RGB the paper's CIFAR network (4096 features, FC 256).
    """

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        num_classes: int,
        condition_dim: int = 0,
        conditioning: str = "concat",
        hidden_units: int = 0,
        ensemble_size: int = 8,
    ) -> None:
        super().__init__()
        channels, height, width = image_shape
        if height % 4 or width % 4:
            raise FedcondError(f"images must have sides divisible by 4 for two poolings, got {height}x{width}")
        cifar_like = channels == 3
        self.condition_dim = condition_dim
        self.ensemble_size = ensemble_size
        self.conditioning = conditioning if condition_dim else "concat"
        self.mechanism = mechanism(self.conditioning)
        self.num_classes = num_classes
        self.features = cifar_features(channels) if cifar_like else small_features(channels)
        hidden = hidden_units or (256 if cifar_like else 128)
        flat = 64 * (height // 4) * (width // 4)
        # The backbone first, for every mechanism, so that the unconditioned and concat networks keep
        # their seeded initial weights (and parameter count) exactly; then the mechanism's own modules.
        self.classifier = nn.Sequential(
            nn.Linear(flat + self.mechanism.first_layer_inputs(condition_dim), hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )
        if condition_dim:
            self.mechanism.add_modules(self, condition_dim, hidden, num_classes)

    def forward(self, images: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        features = self.features(images)
        if not self.condition_dim:
            return self.classifier(features)
        return conditioned_logits(self, features, condition)


#: The tabular MLP's hidden units when ``hidden-units`` is 0.
TABULAR_HIDDEN = 64


class TabularModel(nn.Module):
    """A model over feature vectors. Unconditioned: a linear model (logistic regression on a
    classification task), the model class of the appendix's references (Global, Cluster, Client).
    Conditioned by concat, film or hyper: an MLP, features -> FC hidden -> ReLU -> FC outputs, that
    takes s as on the CNN (concat is the appendix's "MLP"); by lin or ens: the network that
    mechanism builds (``fedcond/conditioning``)."""

    def __init__(
        self,
        num_features: int,
        num_classes: int,
        condition_dim: int = 0,
        conditioning: str = "concat",
        hidden_units: int = 0,
        ensemble_size: int = 8,
    ) -> None:
        super().__init__()
        self.num_features = num_features
        self.num_classes = num_classes
        self.condition_dim = condition_dim
        self.ensemble_size = ensemble_size
        self.conditioning = conditioning if condition_dim else "concat"
        if not condition_dim:
            self.linear = nn.Linear(num_features, num_classes)
            return
        self.mechanism = mechanism(conditioning)
        hidden = hidden_units or TABULAR_HIDDEN
        if not self.mechanism.builds_own_model:
            self.classifier = nn.Sequential(
                nn.Linear(num_features + self.mechanism.first_layer_inputs(condition_dim), hidden),
                nn.ReLU(),
                nn.Linear(hidden, num_classes),
            )
        self.mechanism.add_modules(self, condition_dim, hidden, num_classes)

    def forward(self, features: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        if not self.condition_dim:
            return self.linear(features)
        return conditioned_logits(self, features, condition)


#: Any model a run builds: a CNN for images, a tabular model for feature vectors.
Network = ConditionalCNN | TabularModel


def build_model(
    input_shape: tuple[int, ...],
    num_classes: int,
    condition_dim: int,
    seed: int,
    conditioning: str = "concat",
    hidden_units: int = 0,
    ensemble_size: int = 8,
) -> Network:
    """A freshly initialised model, a CNN for images and a ``TabularModel`` for feature vectors; the
    same seed gives the same weights on every machine."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    if len(input_shape) == 1:
        check_conditioning_for(conditioning, "tabular", "a tabular task")
        model: Network = TabularModel(
            input_shape[0], num_classes, condition_dim, conditioning, hidden_units, ensemble_size
        )
    else:
        check_conditioning_for(conditioning, "cnn", "an image dataset")
        model = ConditionalCNN(input_shape, num_classes, condition_dim, conditioning, hidden_units, ensemble_size)  # type: ignore[arg-type]
    torch.random.set_rng_state(generator_state)
    return model


def run_fingerprint_size(config: RunConfig, num_classes: int) -> int:
    """The length of the run's fingerprint: the conditioned model's input size."""
    return fingerprint_size(
        config.fingerprint,
        config.fingerprint_dim,
        num_classes,
        config.num_clusters,
        phi_features(config.dataset, config.fingerprint_encoder),
    )


def build_run_model(config: RunConfig, num_classes: int, conditioned: bool, seed: int | None = None) -> Network:
    """The model of a run, as the server and every client build it (``seed`` defaults to the run's)."""
    from fedcond.datasets import dataset_spec

    return build_model(
        dataset_spec(config.dataset).input_shape,
        num_classes,
        run_fingerprint_size(config, num_classes) if conditioned else 0,
        config.seed if seed is None else seed,
        config.conditioning,
        config.hidden_units,
        config.ensemble_size,
    )


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """The model's state as NumPy arrays, in ``state_dict`` order (what travels over Flower)."""
    return [tensor.detach().cpu().numpy().copy() for tensor in model.state_dict().values()]


def set_weights(model: nn.Module, weights: list[np.ndarray]) -> None:
    """Load arrays produced by ``get_weights`` of an identically built model."""
    state = model.state_dict()
    if len(weights) != len(state):
        raise FedcondError(
            f"received {len(weights)} arrays for a model with {len(state)}; server and client disagree "
            "on the model (same method, dataset and fingerprint-dim everywhere?)"
        )
    loaded = {}
    for (name, current), array in zip(state.items(), weights, strict=True):
        if tuple(current.shape) != tuple(array.shape):
            raise FedcondError(f"array for {name} has shape {array.shape}, the model expects {tuple(current.shape)}")
        loaded[name] = torch.from_numpy(np.asarray(array)).to(current.dtype)
    model.load_state_dict(loaded)
