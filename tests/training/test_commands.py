"""The canonical command line recorded in model cards (``specdraft.training.commands.command_line``)."""

import argparse

from specdraft.training.commands import add_training_commands, command_line


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specdraft")
    add_training_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_command_line_records_every_parsed_flag():
    args = _parse("pretrain", "--out", "run", "--target", "t", "--steps", "7", "--no-bf16")
    line = command_line(args)
    assert line.startswith("specdraft pretrain --out run --steps 7 ")
    assert " --no-bf16 " in line and " --target t " in line


def test_skipped_fields_are_left_out():
    """A pretrain run sized by --tokens records no --steps (the parsed default is not what ran)."""
    args = _parse("pretrain", "--out", "run", "--target", "t", "--tokens", "5000")
    assert " --steps " not in command_line(args, ("steps",)) and " --tokens 5000" in command_line(args, ("steps",))
    assert " --steps 1000 " in command_line(args)
