"""`llmgw`: the umbrella command (`llmgw ctl ...`)."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(
            "usage: llmgw ctl COMMAND ... | llmgw --version\n\n"
            "  ctl    the operator's CLI (llmgw ctl --help)"
        )
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        # The installed distribution's version: what a node's bootstrap installed.
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"llmgw {version('llmgw')}")
        except PackageNotFoundError:
            from llmgw import __version__

            print(f"llmgw {__version__} (not installed as a distribution)")
        return 0
    if args[0] == "ctl":
        from llmgw.ctl import main as ctl_main

        return ctl_main(args[1:])
    print(f"llmgw: unknown command {args[0]!r}; try `llmgw ctl --help`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
