"""Settings that belong to no one method, grouped by topic: the ones every client reads
(``CLIENT_SHARED``) and the server optimiser of every method whose server averages a model
(``SERVER_OPTIMISER``); the server's method table adds them and the server's own (fedcond.federation.methods).
Each option is declared next to the code that reads it; this module only groups them."""

from __future__ import annotations

from dataclasses import dataclass

from fedcond.config import Option
from fedcond.model import server_optimiser
from fedcond.newcomers import NEWCOMER_STEPS
from fedcond.privacy import dp as privacy
from fedcond.privacy import secure_aggregation as secagg_settings
from fedcond.records.metrics import PER_CLASS_ACCURACY


@dataclass(frozen=True)
class SharedOptions:
    """Settings every federated method has (or the run itself has); ``topic`` is their heading in
    docs/settings.md (fedcond.tools.settings, written by a checkout's tools/docs.py)."""

    topic: str
    owner: str
    options: tuple[Option, ...]


EVERY_METHOD = "every federated method"
#: The shared settings a ClientApp reads (its sample-level privacy, its secure aggregation, what a
#: newcomer does): a client types and checks these, its own class's and the core settings.
CLIENT_SHARED = (
    SharedOptions("privacy", EVERY_METHOD, privacy.OPTIONS),
    SharedOptions("secure-aggregation", EVERY_METHOD, secagg_settings.OPTIONS),
    SharedOptions("newcomers", EVERY_METHOD, (NEWCOMER_STEPS,)),
    SharedOptions("evaluation", EVERY_METHOD, (PER_CLASS_ACCURACY,)),
)
CLIENT_SHARED_OPTIONS = tuple(option for group in CLIENT_SHARED for option in group.options)
#: FedAvgM on the server (``fedcond.model.server_optimiser``): one meaning for every method whose server
#: averages a model; the others refuse a changed value (their strategy's ``server_step_refusal``). The
#: server alone reads it: a ClientApp keeps it as given.
SERVER_OPTIMISER = SharedOptions("server-optimiser", server_optimiser.OWNER, server_optimiser.OPTIONS)
