"""The tools on top of the core and the Flower layer: the ``fedcond`` command (``cli``), experiments
(``experiment``), reports (``report``) and real deployments (``deploy``)."""
