"""The model as torch modules (DESIGN §2): the sparse decoder every family shares
(``decoder``), the DeepSeek-V3.2 / GLM-5 family (``mla_*``), the home-made preset family
(``preset_*``) and the layers both use. What a model *is* (topology, config.json, presets)
is ``dhisparse.family``; reading and writing weights is ``services.worker.weights``."""
