"""Placeholder: filled in by its issue."""


def register(subparsers) -> None:
    pass
