import numpy as np
import pytest
import torch

from fedcond.errors import FedcondError
from fedcond.model.conditioning import MECHANISMS, conditions, mechanism
from fedcond.model.networks import TABULAR_HIDDEN, build_model, count_parameters, get_weights, set_weights


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


CNN_MECHANISMS = [name for name in MECHANISMS if conditions(name, "cnn")]
TABULAR_MECHANISMS = [name for name in MECHANISMS if conditions(name, "tabular")]
#: A small input of each model kind, and the hidden units its conditioned network has by default.
KIND_SHAPE = {"cnn": ((1, 8, 8), 128), "tabular": ((10,), TABULAR_HIDDEN)}


def test_every_mechanism_conditions_some_model():
    assert set(CNN_MECHANISMS) | set(TABULAR_MECHANISMS) == set(MECHANISMS)
    assert {"concat", "film", "hyper", "ens"} <= set(TABULAR_MECHANISMS) and "lin" not in CNN_MECHANISMS
    assert "ens" in CNN_MECHANISMS  # a mixture of heads


@pytest.mark.parametrize("conditioning", CNN_MECHANISMS)
@pytest.mark.parametrize(("shape", "hidden"), [((1, 28, 28), 128), ((1, 8, 8), 128), ((3, 32, 32), 256)])
def test_every_mechanism_in_the_table_is_its_module_and_adds_what_it_says(conditioning, shape, hidden):
    """One line in fedcond.model.conditioning.MECHANISMS and one module defining MECHANISM: its name is its
    key, and the parameters it says it adds are the ones the network gains."""
    chosen = mechanism(conditioning)
    assert chosen.name == conditioning and chosen.summary
    plain = count_parameters(build_model(shape, 10, 0, seed=0))
    conditioned = count_parameters(build_model(shape, 10, 6, seed=0, conditioning=conditioning))
    assert conditioned - plain == chosen.extra_parameters(6, hidden, 10)


@pytest.mark.parametrize("conditioning", TABULAR_MECHANISMS)
def test_every_tabular_mechanism_adds_what_it_says_to_the_linear_model(conditioning):
    """Unconditioned, a tabular model is a linear model (10 x 2 + 2); concat, film and hyper condition
    an MLP over the features (concat: the appendix's MLP), lin and ens build their own network."""
    chosen = mechanism(conditioning)
    assert count_parameters(build_model((10,), 2, 0, seed=0)) == 22
    conditioned = count_parameters(build_model((10,), 2, 12, seed=0, conditioning=conditioning))
    mlp = 10 * TABULAR_HIDDEN + TABULAR_HIDDEN + TABULAR_HIDDEN * 2 + 2  # the MLP the first three condition
    plain = 22 if chosen.builds_own_model else mlp
    assert conditioned - plain == chosen.extra_parameters(12, TABULAR_HIDDEN, 2, 10)


@pytest.mark.parametrize(
    ("conditioning", "parameters"),
    # lin: Linear(12 -> 2 x 11); ens: 8 experts Linear(10 -> 2) and a gate Linear(12 -> 8).
    [("lin", 13 * 22), ("ens", 8 * 22 + 13 * 8), ("concat", 22 * 64 + 64 + 64 * 2 + 2)],
)
def test_the_appendix_mechanisms_have_the_size_of_their_equations(conditioning, parameters):
    assert count_parameters(build_model((10,), 2, 12, seed=0, conditioning=conditioning)) == parameters


def test_lin_starts_as_one_shared_linear_model_and_ens_as_an_even_blend():
    features = torch.randn(5, 10)
    for conditioning in ("lin", "ens"):
        model = build_model((10,), 2, 4, seed=0, conditioning=conditioning)
        torch.testing.assert_close(model(features, torch.zeros(1, 4)), model(features, torch.randn(1, 4)))
    images = torch.rand(3, 1, 8, 8)
    heads = build_model((1, 8, 8), 10, 4, seed=0, conditioning="ens")
    torch.testing.assert_close(heads(images, torch.zeros(1, 4)), heads(images, torch.randn(1, 4)))


def test_ens_on_a_cnn_keeps_the_backbones_seeded_weights_and_head_and_blends_corrections_of_it():
    plain, heads = build_model((1, 8, 8), 10, 0, seed=0), build_model((1, 8, 8), 10, 4, seed=0, conditioning="ens")
    mixed = dict(heads.named_parameters())
    for name, parameter in plain.named_parameters():
        torch.testing.assert_close(mixed[name], parameter)
    images = torch.rand(3, 1, 8, 8)
    # Expert k's head is the backbone's head plus a small correction D_k, of a tenth of its scale.
    start = heads(images, torch.zeros(1, 4)) - plain(images)
    assert 0 < start.abs().max() < 0.1 * plain(images).abs().max()
    with torch.no_grad():  # expert 3 alone, with its correction only in its rows of the heads' layer
        heads.gate.bias.copy_(torch.tensor([-50.0] * 3 + [50.0] + [-50.0] * 4))
        heads.heads.weight.zero_()
        heads.heads.bias.zero_()
        heads.heads.bias[30:40] = 1.0
    torch.testing.assert_close(heads(images, torch.zeros(1, 4)), plain(images) + 1.0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("conditioning", "kind"), [(name, "cnn") for name in CNN_MECHANISMS]
                         + [(name, "tabular") for name in TABULAR_MECHANISMS])  # fmt: skip
def test_every_conditioning_trains_and_uses_the_fingerprint(conditioning, kind):
    shape, _ = KIND_SHAPE[kind]
    model = build_model(shape, 10, 4, seed=0, conditioning=conditioning)
    inputs, labels = torch.rand(16, *shape), torch.randint(0, 10, (16,))
    loss = torch.nn.functional.cross_entropy(model(inputs, torch.ones(1, 4)), labels)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * parameter.grad)
    assert not torch.allclose(model(inputs, torch.zeros(1, 4)), model(inputs, torch.ones(1, 4)))


def test_a_mechanism_is_refused_on_a_model_it_does_not_condition():
    with pytest.raises(FedcondError, match="conditioning=lin is not offered for the cnn model"):
        build_model((1, 8, 8), 10, 4, seed=0, conditioning="lin")
    with pytest.raises(FedcondError, match="unknown conditioning"):
        build_model((10,), 2, 4, seed=0, conditioning="mlp")


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
