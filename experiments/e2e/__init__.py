"""``make bench-e2e``: time to a validation-loss target over a rate-limited loopback, and the
learning-rate sweep that fixes the target (``python -m experiments.e2e.run``)."""
