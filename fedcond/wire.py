"""How fedcond encodes small vectors in Flower configs and properties (which carry scalars/bytes)."""

from __future__ import annotations

import numpy as np

from fedcond.errors import FedcondError

FLOAT64 = "<f8"
UINT64 = "<u8"


def array_to_bytes(vector: np.ndarray, dtype: str = FLOAT64) -> bytes:
    return np.ascontiguousarray(vector, dtype=dtype).tobytes()


def array_from_bytes(payload: object, name: str, dtype: str = FLOAT64) -> np.ndarray:
    if not isinstance(payload, bytes) or len(payload) % 8:
        raise FedcondError(f"'{name}' is missing or malformed; server and client run different fedcond versions")
    return np.frombuffer(payload, dtype=dtype).copy()
