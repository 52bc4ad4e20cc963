import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcond.errors import FedcondError
from fedcond.model.networks import build_model, get_weights
from fedcond.model.training import MomentumSGD, ProximalTerm, TrainSettings, evaluate, run_epochs, train


def toy_data(n=64):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=n)
    images = rng.random((n, 1, 8, 8)).astype(np.float32) * 0.2
    images[labels == 1, :, :4, :] += 0.8  # class 1: bright top half
    return images, labels


def test_local_training_learns_and_is_reproducible():
    images, labels = toy_data()
    settings = TrainSettings(epochs=15, batch_size=16, learning_rate=0.05, momentum=0.9)
    first, second = build_model((1, 8, 8), 2, 0, seed=0), build_model((1, 8, 8), 2, 0, seed=0)
    before = evaluate(first, images, labels, None)
    train(first, images, labels, None, settings, seed=7)
    train(second, images, labels, None, settings, seed=7)
    after = evaluate(first, images, labels, None)
    assert after.loss < before.loss and after.accuracy > 0.9
    for a, b in zip(get_weights(first), get_weights(second), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("momentum", "proximal"), [(0.9, False), (0.0, False), (0.5, True)])
def test_momentum_sgd_takes_torch_optim_sgds_steps_bit_for_bit(momentum, proximal, one_thread):
    """fedcond's optimiser replaces torch.optim.SGD (which imports torch._dynamo, seconds per deployed
    fit message): the same weights after the same steps, every bit, momentum carried across calls."""
    images, labels = toy_data(96)
    condition = np.linspace(-1, 1, 4).astype(np.float32)
    settings = TrainSettings(epochs=2, batch_size=16, learning_rate=0.05, momentum=momentum)
    ours, theirs = build_model((1, 8, 8), 2, 4, seed=3), build_model((1, 8, 8), 2, 4, seed=3)
    anchor = build_model((1, 8, 8), 2, 4, seed=4)
    data = (torch.from_numpy(images), torch.from_numpy(labels), torch.from_numpy(condition)[None, :])
    optimisers = (
        MomentumSGD(ours.parameters(), settings.learning_rate, momentum),
        torch.optim.SGD(theirs.parameters(), lr=settings.learning_rate, momentum=momentum),
    )
    for model, optimiser in zip((ours, theirs), optimisers, strict=True):
        generator = torch.Generator().manual_seed(11)
        for _ in range(2):  # a pooled run continues its optimiser (momentum) across rounds
            run_epochs(model, optimiser, data, settings, generator, ProximalTerm(anchor, 0.3) if proximal else None)
    for mine, reference in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True):
        assert torch.equal(mine, reference)
    initial = build_model((1, 8, 8), 2, 4, seed=3).state_dict()["classifier.0.weight"]
    assert not torch.equal(ours.state_dict()["classifier.0.weight"], initial)  # it did train


def test_training_never_imports_torch_dynamo():
    script = (
        "import sys, numpy as np\n"
        "from fedcond.model.networks import build_model\n"
        "from fedcond.model.training import TrainSettings, train\n"
        "model = build_model((1, 8, 8), 2, 0, seed=0)\n"
        "train(model, np.zeros((8, 1, 8, 8), np.float32), np.arange(8) % 2, None, TrainSettings(1, 4, 0.1, 0.9), 0)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, check=True)
    assert result.stdout.strip() == "False"


def test_nan_loss_stops_with_the_fix():
    images, labels = toy_data()
    model = build_model((1, 8, 8), 2, 0, seed=0)
    with pytest.raises(FedcondError, match="lower learning-rate"):
        train(model, images * 1e30, labels, None, TrainSettings(3, 16, 1e6, 0.9), seed=0)


def conv_weight(model: torch.nn.Module) -> torch.Tensor:
    return next(parameter for parameter in model.parameters() if parameter.dim() == 4)


def test_channels_last_trains_and_evaluates_in_that_layout_and_a_reused_model_goes_back():
    """channels-last (CIFAR-shaped images): the convolutions run in that layout, the numbers agree
    with the default layout's to rounding, and a model reused by a default-layout run is put back."""
    rng = np.random.default_rng(0)
    images, labels = rng.random((48, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 48)
    plain, last = (TrainSettings(1, 16, 0.05, 0.9, channels_last=flag) for flag in (False, True))
    default_model, channels_last_model = (
        build_model((3, 32, 32), 10, 0, seed=0),
        build_model((3, 32, 32), 10, 0, seed=0),
    )
    loss = train(default_model, images, labels, None, plain, seed=1)
    loss_last = train(channels_last_model, images, labels, None, last, seed=1)
    weight = conv_weight(channels_last_model)
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
    assert loss_last == pytest.approx(loss, rel=1e-4)
    for a, b in zip(get_weights(default_model), get_weights(channels_last_model), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)  # rounding, not another model
    evaluated = evaluate(channels_last_model, images, labels, None, channels_last=True)
    assert evaluated.loss == pytest.approx(evaluate(default_model, images, labels, None).loss, rel=1e-4)
    evaluate(channels_last_model, images, labels, None)  # a default-layout run reusing the model
    assert conv_weight(channels_last_model).is_contiguous()
