"""Evaluation: metrics with room-clustered intervals, protocol runs (`retrojax eval`), reports."""
