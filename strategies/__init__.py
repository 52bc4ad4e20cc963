"""Flower strategy adapters: legacy ``flwr.server.strategy`` subclasses over ``fedcond``'s math."""
