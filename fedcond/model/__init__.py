"""Models: the networks (``networks``), how a model takes a fingerprint (``conditioning``,
``hypernetwork``, ``feature_norm``), local training and scoring (``training``), and what a server does
with models (``aggregation``, ``server_optimiser``, ``head_fit``, ``parameter_tree``, ``store``)."""
