"""``python -m safetrain.cli``: the same as ``python -m safetrain``."""

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
