"""The training harness: tasks, run configurations, the run loop and its crash-safe logs
(``python -m experiments.harness.train``)."""
