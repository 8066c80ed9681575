"""Entry point of the ``oneblock`` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    import oneblock as ob

    cfg = ob.ModelConfig()
    print(ob.count_parameters(cfg).as_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
