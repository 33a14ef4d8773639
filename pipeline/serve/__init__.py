"""An OpenAI-compatible server over a built artifact: ``python -m pipeline.serve ARTIFACT_DIR``.

``engine``: one thread owns the ``Session`` and runs continuous batching (chunked prefill sharing
each step with the decodes, a bounded queue, cancellation, timeouts, speculative rounds with a
draft); ``app``: the FastAPI side (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/ready``, ``/metrics``); ``protocol``: the requests and the error object;
``prompts``: text, chat templates and images into token ids; ``metrics``: Prometheus."""
