"""Entry point: python -m agent <verb> ..., and the `hgemm-agent` console script (entry)."""

import os
import sys

EXIT_INTERRUPTED = 130


def entry() -> int:
    """The command line; Ctrl-C exits 130 without a traceback whenever it comes, importing included."""
    try:
        from agent.cli import main

        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        # exits at once: an interpreter interrupted inside an import would otherwise end itself by SIGINT (exit -2),
        # even with the interrupt handled; what the run wrote is committed already
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)
    return code


if __name__ == "__main__":
    sys.exit(entry())
