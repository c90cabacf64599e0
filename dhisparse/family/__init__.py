"""What a model is, without torch: its topology (``config``), the real families' config.json
(``hf_config``, ``hf_dir``, ``rope_spec``, ``quantization_config``, ``generation``), the
presets (``presets``, ``scaled``), its parameters and held tensors (``hf_size``,
``held_weights``), the parallel layouts' table (``parallel_layout``) and the FP8 KV row formats
(``fp8_kv_format``). Read by the gateway, the capacity model, the worker and training."""
