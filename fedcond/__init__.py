"""fedcond: client-conditional federated learning on Flower.

The flow, one module per step: ``datasets`` -> ``scenarios`` -> ``client_data`` -> ``fingerprint``
-> ``models`` -> ``training``; Flower's adapters live in the top-level ``clients`` and
``strategies`` packages, and ``methods`` pairs them by name; ``history`` records each round.
"""

__version__ = "0.1.0"
