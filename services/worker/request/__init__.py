"""Requests as the engine sees them (``request``), sampling from logits (``sampling``),
incremental text with stop strings (``stop``), the prompt's own logprobs (``prompt_logprobs``),
biases and penalties (``penalties``) and grammars that constrain the output (``grammar``: the
worker's compiler; ``grammar_state``: one request's matcher and masks): the worker's bottom
floor."""
