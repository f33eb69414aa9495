"""The API's language: request bodies (``schemas``), errors, prompts, chat templates, tool
calling (``tools``), infill, the Responses API and embeddings, turned into engine tasks and
back. Above ``server.engine`` (it builds its tasks), below ``server.service`` and
``server.routes``."""
