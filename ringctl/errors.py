"""The one exception type the command line turns into a one-line message and exit status 2."""


class UserError(Exception):
    """Bad input from the user (a file, a key, a flag): say what and where, no traceback."""

    exit_code = 2


# A worker's last stderr line when it fails starts with this; backends read the error from it.
WORKER_ERROR_PREFIX = "ringctl.worker: "
