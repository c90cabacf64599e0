"""Checking the engine's model of an operator's checkpoint against transformers' (the oracle)
on a slice of it: ``dhisparse verify`` (``cli``), the comparison (``compare``), the reference
side (``reference``)."""
