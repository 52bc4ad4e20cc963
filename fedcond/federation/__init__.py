"""The round protocol: everything a federated method runs inside, on Flower.

Server side: the ServerApp (``server_app``), its round loop (``round_loop``), the base strategy every
method's strategy builds on (``strategy``, with the family bases ``cluster_models`` and ``peer``), what
each round records (``round_record``), who is asked (``sampling``, ``membership``), asking nodes and
secure sums (``exchange``, ``secagg_workflow``), Flower's client-level DP wrappers (``client_dp``),
the checks of a run's settings before anything starts (``checks``) and the method table
(``methods``, ``declaration``). Client side: the ClientApp (``client_app``), the base client every
method's client builds on (``client``) and its mods (``secagg_mod``, ``clipping_mod``). Both: the
message keys (``messages``) and who answered what (``participation``).

A method is its strategy in ``strategies/<name>.py`` and its client in ``clients/<name>.py``, found
by name; they hold what that method does differently, and this package the rest.
"""
