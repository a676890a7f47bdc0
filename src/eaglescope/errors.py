"""The one exception type for user-facing failures; the CLI prints it as a single stderr line."""


class EagleScopeError(Exception):
    """A failure caused by the user's input (bad checkpoint, bad flags, bad data), not by a bug."""
