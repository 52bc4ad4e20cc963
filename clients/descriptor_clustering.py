"""Descriptor clustering's client: FedAvg's (train the cluster model it receives, return it), and,
before round 1, its descriptor for the server to cluster (fedcond.fingerprint.descriptor_clustering)."""

from __future__ import annotations

from fedcond.data.client_data import client_fingerprint
from fedcond.federation.client import FedcondClient
from fedcond.federation.messages import DESCRIPTOR, STEP, STEP_DESCRIPTOR, array_to_bytes


class DescriptorClient(FedcondClient):
    """Its descriptor is its raw fingerprint (``fingerprint``, ``fingerprint-dim``,
    ``fingerprint-encoder``: the statistics Conditional is fed), sent once, in the clear: unlike the
    paper's method, the server sees each client's statistics. A newcomer sends its descriptor too
    and is served the model of the cluster it is nearest to."""

    released_beyond_training = "a descriptor of their training data, unnoised"

    def answer_before_training(self, question: dict[str, object]) -> dict[str, object]:
        if question.get(STEP) == STEP_DESCRIPTOR:
            return {DESCRIPTOR: array_to_bytes(client_fingerprint(self.run_config, self.data))}
        return super().answer_before_training(question)


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = DescriptorClient
