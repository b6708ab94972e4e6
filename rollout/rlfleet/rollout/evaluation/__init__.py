"""Evaluation: a policy graded on a whole suite, and the run's evaluator program that does it
every few versions."""
