"""Settings as dataclass fields that carry their help text: one place for a default, its
reason and its description. The CLI's flags, their help (`lorac train --help`) and the docs'
tables are read from these fields (runtime/cli.py), never restated."""
from __future__ import annotations

from dataclasses import MISSING, field, fields


def setting(default=MISSING, help: str = "", *, factory=None, **meta):  # noqa: A002 - argparse's word
    """A dataclass field with `help` (one line for `--help`) and any other metadata
    (e.g. optimizer=True: an optimizer setting a resumed run must keep)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def like(cls, name: str, **meta):
    """The field `name` of dataclass `cls` again, same default and help, in another dataclass
    (TrainConfig's optimizer settings are LoraPlusConfig's)."""
    f = next(f for f in fields(cls) if f.name == name)
    rest = {k: v for k, v in f.metadata.items() if k != "help"}
    return setting(f.default, f.metadata.get("help", ""), **{**rest, **meta})


def help_of(cls, name: str) -> str:
    return next(f.metadata.get("help", "") for f in fields(cls) if f.name == name)
