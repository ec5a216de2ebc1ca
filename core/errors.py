"""The one exception type for bad input: a file, a dataset, a model the user handed us.

It is a ValueError so plain `except ValueError` still catches it, and its message is a
single line that names the file (and line, or tensor) at fault, so the CLI can print it
as is and exit non-zero. Whatever a message quotes from the input (a tensor name, a JSON
key) cannot break that line: characters that are not printable are written as escapes.
"""


class LoracError(ValueError):
    """Bad input; the message is one line meant for the user."""

    def __init__(self, message=""):
        text = str(message)
        if not text.isprintable():
            text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
        super().__init__(text)
