"""The one error type users can cause: bad flags, checkpoints, artifacts or requests."""


class Pt2ServeError(Exception):
    """A problem the user can fix; the message says what was wrong and what to do.

    The CLI prints it without a traceback and exits non-zero; the server turns it into a 4xx.
    """
