import numpy as np
import pytest
import torch

from fedcond.conditioning import MECHANISMS, mechanism
from fedcond.errors import FedcondError
from fedcond.models import build_model, count_parameters, get_weights, set_weights


def test_paper_mnist_network_has_425738_parameters_when_conditioned():
    assert count_parameters(build_model((1, 28, 28), 10, 32, seed=0)) == 425_738
    assert count_parameters(build_model((1, 28, 28), 10, 0, seed=0)) == 425_738 - 32 * 128


@pytest.mark.parametrize(("shape", "condition_dim"), [((1, 28, 28), 32), ((1, 8, 8), 32), ((1, 8, 8), 0)])
def test_output_shape(shape, condition_dim):
    model = build_model(shape, 7, condition_dim, seed=0)
    condition = torch.ones(1, condition_dim) if condition_dim else None
    assert model(torch.zeros(5, *shape), condition).shape == (5, 7)


@pytest.mark.parametrize(
    ("conditioning", "extra"),
    # film: gamma and beta, each Linear(32, 128); hyper: one (classes x (hidden + 1)) head per dimension.
    [("concat", 32 * 128), ("film", 2 * (32 * 128 + 128)), ("hyper", 32 * 10 * 129)],
)
def test_conditioning_parameter_counts(conditioning, extra):
    plain = 425_738 - 32 * 128
    assert count_parameters(build_model((1, 28, 28), 10, 32, seed=0, conditioning=conditioning)) == plain + extra


def test_concat_keeps_its_seeded_weights_and_film_starts_as_the_plain_network():
    concat = build_model((1, 8, 8), 10, 4, seed=0)
    explicit = build_model((1, 8, 8), 10, 4, seed=0, conditioning="concat")
    for a, b in zip(get_weights(concat), get_weights(explicit), strict=True):
        np.testing.assert_array_equal(a, b)
    film = build_model((1, 8, 8), 10, 4, seed=0, conditioning="film")
    images = torch.rand(3, 1, 8, 8)
    torch.testing.assert_close(film(images, torch.zeros(1, 4)), film(images, torch.ones(1, 4)))


@pytest.mark.parametrize("conditioning", list(MECHANISMS))
@pytest.mark.parametrize(("shape", "hidden"), [((1, 28, 28), 128), ((1, 8, 8), 128), ((3, 32, 32), 256)])
def test_every_mechanism_in_the_table_is_its_module_and_adds_what_it_says(conditioning, shape, hidden):
    """One line in fedcond.conditioning.MECHANISMS and one module defining MECHANISM: its name is its
    key, and the parameters it says it adds are the ones the network gains."""
    chosen = mechanism(conditioning)
    assert chosen.name == conditioning and chosen.summary
    plain = count_parameters(build_model(shape, 10, 0, seed=0))
    conditioned = count_parameters(build_model(shape, 10, 6, seed=0, conditioning=conditioning))
    assert conditioned - plain == chosen.extra_parameters(6, hidden, 10)


@pytest.mark.parametrize("conditioning", list(MECHANISMS))
def test_every_conditioning_trains_and_uses_the_fingerprint(conditioning):
    model = build_model((1, 8, 8), 10, 4, seed=0, conditioning=conditioning)
    images, labels = torch.rand(16, 1, 8, 8), torch.randint(0, 10, (16,))
    loss = torch.nn.functional.cross_entropy(model(images, torch.ones(1, 4)), labels)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * parameter.grad)
    assert not torch.allclose(model(images, torch.zeros(1, 4)), model(images, torch.ones(1, 4)))


def test_conditioning_changes_the_output():
    model = build_model((1, 8, 8), 10, 4, seed=0)
    images = torch.rand(3, 1, 8, 8)
    assert not torch.allclose(model(images, torch.zeros(1, 4)), model(images, torch.ones(1, 4)))


def test_same_seed_same_weights_and_weights_round_trip():
    first, second = build_model((1, 8, 8), 10, 0, seed=3), build_model((1, 8, 8), 10, 0, seed=3)
    for a, b in zip(get_weights(first), get_weights(second), strict=True):
        np.testing.assert_array_equal(a, b)
    other = build_model((1, 8, 8), 10, 0, seed=4)
    set_weights(other, get_weights(first))
    for a, b in zip(get_weights(first), get_weights(other), strict=True):
        np.testing.assert_array_equal(a, b)


def test_mismatched_weights_are_refused_with_a_clear_error():
    conditioned, plain = build_model((1, 8, 8), 10, 32, seed=0), build_model((1, 8, 8), 10, 0, seed=0)
    with pytest.raises(FedcondError, match="expects"):
        set_weights(plain, get_weights(conditioned))
