"""The HTTP application: ``app`` (FastAPI, wiring every layer together), its middleware,
CORS and the Prometheus metrics. The top of the package beside ``server.cli.main``."""
