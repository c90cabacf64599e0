"""What a prompt must be for an engine to take it: a client's mistake is a ValueError with the
reason, before anything is queued."""

from __future__ import annotations


def check_prompt(
    prompt_ids: list[int], vocab_size: int, max_model_len: int, tokens_capacity: int
) -> None:
    """Raises ValueError for an empty prompt, an id outside the vocabulary, or a prompt that
    leaves no room for a token in the context or in the worker's KV capacity."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens leaves no room in the context of "
            f"{max_model_len} tokens"
        )
    if len(prompt_ids) >= tokens_capacity:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens exceeds this worker's KV capacity of "
            f"{tokens_capacity} tokens"
        )
