"""The methods' server sides, one module per method, found by name: ``METHOD = Declaration(...)`` and
the strategy class it names, holding what that method's server does differently. The round protocol
they build on is fedcond/federation/, whose method table imports every module here
(``fedcond.federation.methods.method_modules``)."""
