"""Optax gradient transformations built on the compressors and collectives."""
