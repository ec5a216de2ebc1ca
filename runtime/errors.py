"""The one exception type for bad input: a file, a dataset, a model the user handed us.

It is a ValueError so plain `except ValueError` still catches it, and its message is a
single line that names the file (and line, or tensor) at fault, so the CLI can print it
as is and exit non-zero.
"""


class LoracError(ValueError):
    """Bad input; the message is one line meant for the user."""
