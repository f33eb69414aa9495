"""The command line: llama-server's flags (``flags``), the Settings they fill (``config``) and
the entry point (``main``, which builds the app and runs uvicorn).

Kept empty of imports on purpose: ``config`` and ``flags`` are data the lower layers read
(Settings), while ``main`` sits above everything; importing ``server.cli.config`` must not
pull in the app. Run ``python -m server`` or the ``llama-slot-server`` script.
"""
