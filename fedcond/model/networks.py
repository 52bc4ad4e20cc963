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

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.fingerprint.fingerprints import fingerprint_size, phi_features
from fedcond.model.conditioning import check_conditioning_for, condition_scale_factor, mechanism


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


#: ``feature-norm=group``: groups per GroupNorm layer (4 channels a group at 32, 8 at 64).
NORM_GROUPS = 8


def _conv_norm(in_channels: int, out_channels: int, feature_norm: str) -> list[nn.Module]:
    norm = nn.GroupNorm(NORM_GROUPS, out_channels) if feature_norm == "group" else nn.BatchNorm2d(out_channels)
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1), norm, nn.ReLU()]


def cifar_features(channels: int, feature_norm: str = "batch") -> nn.Sequential:
    """The paper's CIFAR stack: 2x Conv32 + Pool + 2x Conv64 + Pool, with batch norm (4096 features at
    32x32); ``feature_norm="group"``: group norm in its place (the same parameters, no statistics)."""
    return nn.Sequential(
        *_conv_norm(channels, 32, feature_norm), *_conv_norm(32, 32, feature_norm), nn.MaxPool2d(2),
        *_conv_norm(32, 64, feature_norm), *_conv_norm(64, 64, feature_norm), nn.MaxPool2d(2),
        nn.Flatten(),
    )  # fmt: skip


def has_batch_norm(input_shape: tuple[int, ...]) -> bool:
    """Whether the network built for ``input_shape`` normalises its features (the CIFAR stack: RGB images)."""
    return len(input_shape) == 3 and input_shape[0] == 3


@dataclass(frozen=True)
class ConditioningSettings:
    """How the network reads the fingerprint and normalises its features, beyond ``conditioning``:
    ``condition-scale``, ``hyper-init`` and ``feature-norm`` (``fedcond.config``); the defaults are the
    paper's network."""

    condition_scale: str = "none"
    hyper_init: str = "random"
    feature_norm: str = "batch"

    @classmethod
    def of(cls, config: RunConfig) -> ConditioningSettings:
        return cls(config.condition_scale, config.hyper_init, config.feature_norm)


def conditioned_logits(model: nn.Module, features: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
    """A conditioned network's outputs from its features and the client's fingerprint, one row (1, d)
    broadcast to every sample or one per sample, as its mechanism computes them, after the model's
    ``condition_scale`` (``condition-scale``)."""
    if condition is None:
        raise ValueError("a conditioned model needs its client's fingerprint")
    if model.condition_scale != 1.0:
        condition = condition * model.condition_scale
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
        conditioning_settings: ConditioningSettings | None = None,
    ) -> None:
        super().__init__()
        channels, height, width = image_shape
        if height % 4 or width % 4:
            raise FedcondError(f"images must have sides divisible by 4 for two poolings, got {height}x{width}")
        cifar_like = channels == 3
        settings = conditioning_settings or ConditioningSettings()
        self.condition_dim = condition_dim
        self.ensemble_size = ensemble_size
        self.condition_scale = condition_scale_factor(settings.condition_scale, condition_dim)
        self.hyper_init = settings.hyper_init
        self.conditioning = conditioning if condition_dim else "concat"
        self.mechanism = mechanism(self.conditioning)
        self.num_classes = num_classes
        self.features = cifar_features(channels, settings.feature_norm) if cifar_like else small_features(channels)
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
        conditioning_settings: ConditioningSettings | None = None,
    ) -> None:
        super().__init__()
        settings = conditioning_settings or ConditioningSettings()
        self.num_features = num_features
        self.num_classes = num_classes
        self.condition_dim = condition_dim
        self.ensemble_size = ensemble_size
        self.condition_scale = condition_scale_factor(settings.condition_scale, condition_dim)
        self.hyper_init = settings.hyper_init
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
    conditioning_settings: ConditioningSettings | None = None,
) -> Network:
    """A freshly initialised model, a CNN for images and a ``TabularModel`` for feature vectors; the
    same seed gives the same weights on every machine."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    if len(input_shape) == 1:
        check_conditioning_for(conditioning, "tabular", "a tabular task")
        model: Network = TabularModel(
            input_shape[0], num_classes, condition_dim, conditioning, hidden_units, ensemble_size,
            conditioning_settings,
        )  # fmt: skip
    else:
        check_conditioning_for(conditioning, "cnn", "an image dataset")
        model = ConditionalCNN(
            input_shape, num_classes, condition_dim, conditioning, hidden_units, ensemble_size,  # type: ignore[arg-type]
            conditioning_settings,
        )  # fmt: skip
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
    from fedcond.data.datasets import dataset_spec

    return build_model(
        dataset_spec(config.dataset).input_shape,
        num_classes,
        run_fingerprint_size(config, num_classes) if conditioned else 0,
        config.seed if seed is None else seed,
        config.conditioning,
        config.hidden_units,
        config.ensemble_size,
        ConditioningSettings.of(config),
    )


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """The model's state as NumPy arrays, in ``state_dict`` order (what travels over Flower)."""
    return [tensor.detach().cpu().numpy().copy() for tensor in model.state_dict().values()]


def trained_arrays(model: nn.Module) -> list[bool]:
    """Per array of ``get_weights``: whether it is a trained weight (not a buffer such as batch
    norm's running statistics or step count)."""
    trained = {name for name, _ in model.named_parameters()}
    return [name in trained for name in model.state_dict()]


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
