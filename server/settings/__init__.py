"""The server's settings: llama-server's flag table (``flags``) and the Settings it fills,
with the environment's ``LLAMA_ARG_*`` variables (``config``). Plain data that every layer
reads; it imports only the leaves (``server.types``, ``server.llama.ggml_types``), never a
layer above, so reading a setting pulls in neither the app nor the engine.

Kept empty of imports on purpose: ``config`` imports pydantic, ``flags`` only the table.
"""
