"""``make bench-net``: real training steps of ``jax.distributed`` processes over a
rate-limited loopback (``python -m experiments.net.run``)."""
