"""The methods' server sides, one module per method, found by name: ``METHOD = Declaration(...)`` and
the strategy class it names, holding what that method's server does differently. The round protocol
they build on is fedcond/federation/; the list of methods is ``METHOD_MODULES`` there."""
