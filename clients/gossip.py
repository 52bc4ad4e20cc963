"""Gossip: each client trains its own model, which the server pairs and averages: the base client, unchanged."""

from clients.fedcond_client import FedcondClient

#: The class the ClientApp finds for this method by its name (clients.app.client_class).
Client = FedcondClient
