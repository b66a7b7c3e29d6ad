"""``make bench-gpu``: the codecs on an accelerator as a fraction of its memory bandwidth
(``python -m experiments.gpu.run``)."""
