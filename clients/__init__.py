"""Flower client adapters: thin ``NumPyClient`` wrappers over ``fedcond``'s training code."""
