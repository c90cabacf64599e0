"""dhisparse: sparse-attention LLM serving over a load-adaptive KV hierarchy."""

__version__ = "0.1.0"
