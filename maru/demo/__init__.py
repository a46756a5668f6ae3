"""Demos and the harness they share with the tests and benchmarks; no part of the connector.

* ``server``: start a ``maru server`` child and wait for its ready line (``ServerProcess``,
  ``EmbeddedServer``).
* ``tiny_model``: a small Llama model with random weights and a local tokenizer (no downloads).
* ``runner``: one vLLM engine in its own process, driven by JSON lines (``EngineProcess``).
* ``two_instances``: ``maru demo``: two vLLM instances share a prompt's KV cache through Maru.
* ``objects``: ``maru demo objects``: two processes share objects through the pool, no vLLM.
"""
