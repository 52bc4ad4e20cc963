"""Gossip: each client trains its own model, which the server pairs and averages: the base client, unchanged."""

from fedcond.federation.client import FedcondClient

#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = FedcondClient
