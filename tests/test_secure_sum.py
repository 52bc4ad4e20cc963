import numpy as np
import pytest

from fedcond import secure_sum
from fedcond.errors import FedcondError


def test_masked_shares_sum_to_the_true_sum_and_hide_each_value():
    rng = np.random.default_rng(0)
    values = [rng.normal(size=9) * 100 for _ in range(5)]
    keys = [secure_sum.new_private_key() for _ in values]
    packed = secure_sum.pack_keys([secure_sum.public_key(key) for key in keys])
    shares = [secure_sum.masked_share(v, k, packed, b"session") for v, k in zip(values, keys, strict=True)]
    np.testing.assert_allclose(secure_sum.open_sum(shares), np.sum(values, axis=0), atol=1e-8)
    for share, value in zip(shares, values, strict=True):
        # A single share decodes to noise of order 2^63 / 2^30, nowhere near the client's value.
        assert np.all(np.abs(secure_sum.from_fixed_point(share) - value) > 1.0)


def test_a_missing_share_leaves_the_sum_unopenable():
    keys = [secure_sum.new_private_key() for _ in range(3)]
    packed = secure_sum.pack_keys([secure_sum.public_key(key) for key in keys])
    shares = [secure_sum.masked_share(np.ones(4), key, packed, b"s") for key in keys]
    assert np.all(np.abs(secure_sum.open_sum(shares[:2]) - 2.0) > 1.0)


def test_a_client_whose_key_was_not_relayed_refuses():
    keys = [secure_sum.new_private_key() for _ in range(2)]
    packed = secure_sum.pack_keys([secure_sum.public_key(keys[0])])
    with pytest.raises(FedcondError, match="not relayed"):
        secure_sum.masked_share(np.ones(2), keys[1], packed, b"s")


def test_non_finite_values_are_refused():
    key = secure_sum.new_private_key()
    packed = secure_sum.pack_keys([secure_sum.public_key(key)])
    with pytest.raises(FedcondError, match="not finite"):
        secure_sum.masked_share(np.array([np.nan]), key, packed, b"s")
