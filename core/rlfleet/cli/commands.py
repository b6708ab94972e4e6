"""Shared shape of the `rlfleet GROUP COMMAND` subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def add_group(
    groups: argparse._SubParsersAction,
    name: str,
    text: str,
    commands: Sequence[tuple[str, Handler, str]],
    add_arguments: Callable[[argparse.ArgumentParser], None],
) -> None:
    """A command group whose commands all take the same arguments."""
    group = groups.add_parser(name, help=text)
    subcommands = group.add_subparsers(dest="command", required=True)
    for command_name, handler, command_text in commands:
        command = subcommands.add_parser(command_name, help=command_text)
        add_arguments(command)
        command.set_defaults(handler=handler)
