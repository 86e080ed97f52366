"""The data layer's one error: a user-facing problem with the data, said in one line."""

__all__ = ["DataError"]


class DataError(ValueError):
    """A user-facing data problem; the message is one line (the CLI prints it and exits 2)."""
