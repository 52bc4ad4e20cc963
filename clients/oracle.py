"""Oracle: each client trains its true cluster's model, which the server sends it: the base client, unchanged."""

from clients.fedcond_client import FedcondClient

#: The class the ClientApp finds for this method by its name (clients.app.client_class).
Client = FedcondClient
