"""Oracle: each client trains its true cluster's model, which the server sends it: the base client, unchanged."""

from fedcond.federation.client import FedcondClient

#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = FedcondClient
