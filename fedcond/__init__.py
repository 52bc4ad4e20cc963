"""fedcond: client-conditional federated learning on Flower.

The core, by concern (none of it imports Flower's layer):

- ``data``: datasets, the paper's shift scenarios, each client's partition, drift.
- ``fingerprint``: what a client computes on its own training data (eigenvalues and the others),
  the fixed encoder it reads images through, the fixed-point encoding of the federated statistics.
- ``model``: the networks, how a model takes a fingerprint (``model.conditioning``), local training
  and scoring, aggregation and the server optimiser.
- ``privacy``: sample-level DP, the secure-aggregation settings, the fingerprint inversion attack.
- ``records``: what a run leaves (history.csv, run.json, checkpoints, provenance, live curves, metrics).

Beside them: ``config`` (the run's settings), ``variants``, ``newcomers``, ``stopping``, ``pooled``
(the paper's pooled protocol). Above the core: ``federation`` (the round protocol on Flower), the
methods (``strategies`` and ``clients``, the top-level folders of a checkout) and ``tools`` (the
command line on top of everything).
"""

__version__ = "0.1.0"
