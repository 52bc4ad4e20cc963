"""Fingerprints: what a client computes on its own training data (``fingerprints``: the paper's
eigenvalues and the alternatives), the fixed encoder images are read through (``encoder``), the
fixed-point encoding of the federated normalisation statistics (``statistics_encoding``), and the
descriptor clustering a competitor uses (``descriptor_clustering``)."""
