"""Pieces of the KV-cache sampler (:mod:`retrojax.sampler`): row bookkeeping, sampling, stop strings."""
