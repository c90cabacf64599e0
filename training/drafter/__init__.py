"""Drafter training: ``data`` (token streams, the frozen target's features and greedy labels,
the random blocks a step drafts) and ``train`` (the loop, ``python -m training.drafter.train``)."""
