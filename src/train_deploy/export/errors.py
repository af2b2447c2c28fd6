"""What loading and using a bundle raises: every message names the file or the value (never a whole input)."""

from __future__ import annotations


class BundleError(ValueError):
    """A bundle or a request to it is unusable; the message names the file or the value."""


class TooLongError(BundleError):
    """A text longer than the context (``too_long: raise``): ``what`` holds ``tokens`` tokens, ``context`` fit; the
    served model words its own fix from these (its clients cannot load with ``too_long``)."""

    def __init__(self, what: str, tokens: int, context: int) -> None:
        super().__init__(f"{what}: {tokens} tokens exceed the model's context of {context} (plus the document "
                         "separator); shorten it or load with too_long='truncate'")
        self.what, self.tokens, self.context = what, tokens, context

    def __reduce__(self):  # pickled (another process) with its fields, not its message
        return type(self), (self.what, self.tokens, self.context)
