"""``python -m aiohicache``: the same command as ``aiohicache``."""

from .cli import main

if __name__ == "__main__":
    main()
