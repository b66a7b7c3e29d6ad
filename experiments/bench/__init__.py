"""``make bench``: the codecs' speed against a copy, the step, memory and PyTorch baselines
on a CPU (``python -m experiments.bench.run``)."""
