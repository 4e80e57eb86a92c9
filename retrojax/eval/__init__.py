"""Evaluation: metrics with Wilson intervals, protocol runs (`retrojax eval`), reports."""
