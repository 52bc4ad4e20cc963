"""Local training only: no model is exchanged."""

from __future__ import annotations

from fedcond.federation.declaration import Declaration, Facts, Release
from fedcond.federation.server_method import ServerMethod


class LocalStrategy(ServerMethod):
    """Local: clients train and evaluate their own models, kept in their state; the server only
    schedules rounds and records the history. Nothing is exchanged (0 bytes).
    """

    secure_aggregation_refusal = "no model leaves a client, so there is nothing to aggregate"
    server_step_refusal = "no model leaves a client: each trains its own"
    serves_held_out_clients = True  # a newcomer has a model of its own: untrained (newcomer-steps train it)


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "each client trains only its own model",
    LocalStrategy,
    Facts(
        "trains its own model, kept in client state", "schedules rounds only", "own model", "nothing",
        "a model of its own, never trained: chance zero-shot, only its k steps teach it",
        "`LocalClient.newcomer_model`", "own untrained",
        "keeps its personal model, trained on the old data, and goes on training it on the new",
        releases=(
            Release(
                "each training round",
                "no model: its training-sample count n and its training loss",
                "n and the training loss",
            ),
        ),
    ),
)  # fmt: skip
