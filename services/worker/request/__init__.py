"""Requests as the engine sees them (``request``), sampling from logits (``sampling``) and
incremental text with stop strings (``stop``), the prompt's own logprobs (``prompt_logprobs``):
the worker's bottom floor."""
