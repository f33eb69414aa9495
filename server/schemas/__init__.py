"""What clients send and are answered with when it is wrong: the request bodies of every
API (``bodies``: OpenAI and llama-server's; ``anthropic_bodies``; ``sampler_fields``,
llama-server's fields beyond OpenAI's), OpenAI-shaped errors (``errors``), the one
bounded JSON reader (``json_body``) and resumable streams' names (``stream_ids``). Every
number is range-checked here, before anything reaches llama.cpp. Imports only the leaves
and ``server.settings``."""
