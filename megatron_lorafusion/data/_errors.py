"""The data layer's error type (its own module so tokenizers and datasets can both raise it)."""


class DataError(ValueError):
    """A dataset row, file or tokenizer that cannot be used; the message names file and row."""
