"""Local training only: no model is exchanged."""

from __future__ import annotations

from strategies.base import FedcondStrategy


class LocalStrategy(FedcondStrategy):
    """Local: clients train and evaluate their own models, kept in their state; the server only
    schedules rounds and records the history. Nothing is exchanged (0 bytes).
    """

    secure_aggregation_refusal = "no model leaves a client, so there is nothing to aggregate"
    serves_held_out_clients = True  # a newcomer has a model of its own: untrained (newcomer-steps train it)
