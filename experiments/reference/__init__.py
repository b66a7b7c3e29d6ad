"""The reference implementations' departures from compjax, transcribed and measured
(``python -m experiments.reference.departures``)."""
