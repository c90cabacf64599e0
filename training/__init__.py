"""Training code, kept apart from the serving worker: ``target`` trains a sparse-attention target
model from scratch (``python -m training.target``), ``drafter`` trains a speculative drafter
against a frozen target (``python -m training.drafter.train``)."""
