"""The methods' client sides, one module per method, found by name: ``Client``, holding what that
method's client does differently from the base client in fedcond/federation/client.py."""
