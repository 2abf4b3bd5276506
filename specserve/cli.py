"""The ``specserve`` command line: serve, generate, demo, bench."""

from __future__ import annotations

import argparse
import importlib
import sys

from engine.allocator import keep_freed_memory

# Sub-commands and the module that implements each; a module exposes add_arguments(parser) and run(args), or a
# table SUBCOMMANDS of its own sub-commands in the same form (``bench``).
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("specserve.serve", "run a draft, target or coordinator gRPC server"),
    "generate": ("specserve.generate", "ask a coordinator for n completions of a prompt"),
    "demo": ("specserve.demo", "start the three services on loopback and run a multi-sample generation"),
    "bench": ("bench", "benchmarks: attention, decode, e2e, load, prefix"),
    "trace": ("specserve.trace", "trace one request through the services and draw where the time goes"),
}


def add_subcommands(parser: argparse.ArgumentParser, table: dict[str, tuple[str, str]], dest: str) -> None:
    """One sub-parser per entry of ``table``, nested where a module has SUBCOMMANDS; the chosen leaf's run is
    stored as ``handler``."""
    sub = parser.add_subparsers(dest=dest, required=True)
    for name, (module_name, help_text) in table.items():
        module = importlib.import_module(module_name)
        command_parser = sub.add_parser(name, help=help_text, description=module.__doc__)
        nested = getattr(module, "SUBCOMMANDS", None)
        if nested is not None:
            add_subcommands(command_parser, nested, f"{name}_command")
        else:
            module.add_arguments(command_parser)
            command_parser.set_defaults(handler=module.run)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser; tests parse deployment commands with it."""
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    add_subcommands(parser, COMMANDS, "command")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit status. Every command runs with freed host
    memory kept for reuse (``engine.allocator``): the services, and the benchmarks that compare against them."""
    keep_freed_memory()
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
