"""``python -m safetrain``: the same command line as the ``safetrain`` script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
