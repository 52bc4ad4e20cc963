"""Data: the datasets (``datasets``, ``cifar``, ``tabular``), the paper's shift scenarios
(``scenarios``), each client's partition and held-out split (``client_data``), and drift (``drift``)."""
