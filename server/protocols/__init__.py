"""The HTTP endpoints, one module per API or endpoint family, as FastAPI routers: bodies in,
answers shaped (JSON or SSE). Where an API is mapped onto chat, its mapping sits beside its
routes (``anthropic`` and ``anthropic_mapping``, ``responses`` and ``responses_mapping``,
``embeddings`` and ``embedding_shapes``). Below only ``server.http`` (the app that mounts
them), the router and the entry point."""
