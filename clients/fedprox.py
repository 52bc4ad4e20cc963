"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks"): FedAvg whose clients
minimise a proximal objective."""

from __future__ import annotations

import numpy as np

from fedcond.config import Option
from fedcond.federation.client import FedcondClient
from fedcond.model.networks import set_weights
from fedcond.model.training import ProximalTerm

MU = Option(
    "fedprox-mu", 0.01,
    "FedProx: mu of the proximal term (mu/2)·‖w - w_global‖² each client adds to its loss; 0 is FedAvg",
    minimum=0,
)  # fmt: skip


class FedProxClient(FedcondClient):
    """Algorithm 2 of the paper, line 4: client k finds w_k^{t+1} ~ argmin_w h_k(w; w^t) =
    F_k(w) + (mu / 2) ||w - w^t||^2, with w^t the global model it received, by the same local epochs of
    SGD every method runs (the paper's gamma-inexact solution is whatever those epochs reach; its
    variable local work per device, for stragglers, is not modelled: fedcond's failure policy covers
    clients that do not answer). The server step (line 6) is FedAvg's sample-weighted mean, so the
    method runs FedAvg's strategy: mu reaches every client in the run config, where Flower's FedProx
    strategy sends it in each round's fit config, the one thing that class adds to FedAvg.
    A newcomer is served the global model, as FedAvg serves it.
    """

    options = (MU,)

    def local_term(self, parameters: list[np.ndarray]) -> ProximalTerm | None:
        mu = MU.of(self.run_config)
        if mu == 0:  # no pull: FedAvg's client exactly, without a second model in memory
            return None
        received = self.fresh_model()
        set_weights(received, parameters)  # w^t, held fixed while the local model moves
        return ProximalTerm(anchor=received, strength=mu)


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = FedProxClient
