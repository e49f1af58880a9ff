"""The one error type `engine serve` turns into a line on stderr and exit status 2."""


class StartupError(Exception):
    """A start-up failure the user fixes (port taken, bad host, a model that cannot be served):
    one line, exit 2."""
