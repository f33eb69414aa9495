"""The command line's entry point (``main``: parses the flags into Settings, builds the app
and runs uvicorn), the router's template process (``zygote``) and ``models`` (the model
arguments ``./serve.sh`` adds). The flags and the Settings they fill live in
``server.settings``, which every layer reads; this package sits above everything. Run
``python -m server`` or the ``llama-slot-server`` script.
"""
