"""FedAvg: every client trains the global model (the base client, unchanged)."""

from clients.fedcond_client import FedcondClient

#: The class the ClientApp finds for this method by its name (clients.app.client_class).
Client = FedcondClient
