"""User-facing errors: raised for bad input/configuration, printed by the CLIs without a traceback."""


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file, incompatible models).

    The message must name the offending field/value and the fix.
    """
