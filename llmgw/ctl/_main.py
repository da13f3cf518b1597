"""`llmgw ctl`: the operator's CLI. Talks to the admin JSON API; `cert` works offline.

The entry point only: the argparse tree is `_args.build_parser` (where a command
is added), the commands are `_fleet`, `_models`, `_accounts` (and `_cert`,
`_onboard`, `_release`), the admin API's client is `_client`, the tables `_tables`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from llmgw.ctl._args import build_parser
from llmgw.errors import ConfigError, LlmgwError


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code, 2 for a configuration problem, 1 for any other error."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # engine arguments, untouched by our parser
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    args.extra = extra
    try:
        rc = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return rc
    except BrokenPipeError:
        # The reader stopped reading (`| head -1`, `| grep -q`): it has what it wanted,
        # and nothing more can be said to it. Nothing is left to flush at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ConfigError as exc:
        print(f"llmgw ctl: {exc}", file=sys.stderr)
        return 2
    except LlmgwError as exc:
        print(f"llmgw ctl: {exc}", file=sys.stderr)
        return 1
