"""Entry point: python -m agent <verb> ..., and the `hgemm-agent` console script (entry)."""

import sys


def entry() -> int:
    """The command line; Ctrl-C while it is still importing exits 130 without a traceback, as it does later."""
    try:
        from agent.cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(entry())
