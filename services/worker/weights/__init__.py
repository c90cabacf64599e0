"""Weights: reading checkpoints tensor by tensor (``checkpoint``, ``loader``), building and
loading models (``model_io``, ``hf_load``), and writing them (``hf_export``, ``fp8_writer``)."""
