"""``make bench-elastic``: elastic DiLoCo on Ray islands under injected faults (a kill with a
restart, a straggler, a poisoned island, a killed synchronizer) against lock-step
``compjax.diloco`` under ``jax.distributed`` with the same kill, over a rate-limited loopback
(``python -m experiments.elastic.run``)."""
