"""The one error of corpus preparation."""


class PrepareError(RuntimeError):
    """Preparation cannot go on; the message says why and what to do."""
