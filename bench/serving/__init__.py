"""Closed-loop serving benchmark (issue 11): the modules behind ``bench/serving.py`` (entry
point) and ``bench/projection.py``.

- ``config``: the run matrix and the closed-loop load;
- ``setup``: target model, drafters, prepared prompt prefixes, KV sizing;
- ``engines`` + ``loop``: the engine-level closed loop over an in-process ``Engine``;
- ``stack`` + ``http_loop``: the same loop over HTTP against the real stack;
- ``run``: a matrix at either level under a time limit; ``cli``: flags and the output JSON;
- ``summary``: a run's metrics; ``report``: markdown table and plots;
- ``scaling``: the projection's per-step bytes, FLOPs and binding resource (pure Python).
"""
