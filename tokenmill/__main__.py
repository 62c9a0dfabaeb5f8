"""`python -m tokenmill` is the `tokenmill` command."""

from tokenmill.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
