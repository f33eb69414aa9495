"""Glue between HTTP handlers and the engine: state, task submission, event streams.

Every generating endpoint goes through ``submit.submit``: it tokenizes off the event loop,
checks the prompts (``validation``), builds the sampler (``sampling``) and generation
settings and hands the tasks to the engine in a ``tasks.TaskGroup``, whose events the
endpoint reads; ``usage`` turns the results into OpenAI's usage and llama-server's timings.
``state`` holds what the routes share (ServerState) and each request's tenant.

Layers, low to high: ``sampling``, ``validation``, ``usage`` (none imports another module
here); ``state`` and ``tasks`` (the engine); ``submit`` (all of them). Import the module that
defines a name: this package re-exports nothing.
"""
