"""Requests as the engine sees them (``request``), sampling from logits (``sampling``) and
incremental text with stop strings (``stop``): the worker's bottom floor."""
