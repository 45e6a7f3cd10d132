"""`python -m sideenv ensure NAME` / `python -m sideenv run NAME -- COMMAND...`."""

from __future__ import annotations

import argparse
import sys

from sideenv import SideEnvError, ensure, location, python_of, run_in
from sideenv.specs import ALL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sideenv", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("list", help="the known environments and whether each is installed")
    for verb in ("ensure", "run"):
        one = sub.add_parser(verb)
        one.add_argument("name", choices=sorted(ALL))
        if verb == "run":
            one.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.verb == "list":
            for name, env in sorted(ALL.items()):
                state = "installed" if python_of(env) else "not installed"
                print(f"{name:12} {state:14} {location(env)}  {env.purpose}")
            return 0
        if args.verb == "ensure":
            print(ensure(ALL[args.name]))
            return 0
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("run needs a command after --")
        return run_in(ALL[args.name], command)
    except SideEnvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
