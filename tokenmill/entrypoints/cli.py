"""The `tokenmill` command: one subcommand per tool, each defined in its own room."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that defines `add_parser(subparsers)`; the parser's `func` runs it.
SUBCOMMANDS = {
    "serve": "tokenmill.entrypoints.serve_cli",
    "generate": "tokenmill.entrypoints.generate_cli",
    "chat": "tokenmill.entrypoints.generate_cli",
    "bench": "tokenmill.bench.cli",
    "plan": "tokenmill.plan.cli",
    "router": "tokenmill.router.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine and tools.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    seen = set()
    for module_name in SUBCOMMANDS.values():
        if module_name in seen:
            continue
        seen.add(module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
