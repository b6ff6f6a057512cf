"""``python -m shardkit.checkpoint inspect|convert``: see :mod:`shardkit.checkpoint.cli`."""

from shardkit.checkpoint.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
