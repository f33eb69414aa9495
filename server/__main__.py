"""``python -m server``: the CLI lives in ``server.cli.main``."""

from server.cli.main import main

if __name__ == "__main__":
    main()
