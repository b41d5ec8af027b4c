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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; with `command`, that one's module alone is imported (the others are
    listed by name): `plan`, `bench serve` and `router` start without importing torch."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine and tools.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    wanted = SUBCOMMANDS.get(command) if command is not None else None
    seen = set()
    for module_name in SUBCOMMANDS.values():
        if module_name in seen or (wanted is not None and module_name != wanted):
            continue
        seen.add(module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_parser(subparsers)
    for name in SUBCOMMANDS:
        if name not in subparsers.choices:
            subparsers.add_parser(name)
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    command = arguments[0] if arguments and arguments[0] in SUBCOMMANDS else None
    args = build_parser(command).parse_args(arguments)
    try:
        result = args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from tokenmill.serving.core_link import EngineStartError

        if not isinstance(exc, EngineStartError):
            raise
        print(f"error: the engine failed to start: {exc}", file=sys.stderr)
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
