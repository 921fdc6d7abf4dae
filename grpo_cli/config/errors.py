"""`UserError`: the base of every error the CLI reports as one paragraph with exit code 2 (no traceback)."""


class UserError(Exception):
    """Bad input (config, data, reward function, engine setup) that the user can fix; the message says how."""
