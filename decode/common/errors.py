"""User-facing errors: raised for bad input/configuration, printed by the CLIs without a traceback."""


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file, incompatible models).

    The message must name the offending field/value and the fix.
    """


def run_user_command(fn, *args, interrupted: str = "interrupted") -> int:
    """Run a CLI body: a UserError prints one line and exits 2, Ctrl-C prints ``interrupted`` and exits 130.

    The body returns an exit code (int) or anything else (e.g. a summary dict), which means success.
    """
    import sys
    try:
        code = fn(*args)
        return code if isinstance(code, int) and not isinstance(code, bool) else 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except BrokenPipeError:  # `decode compare ... | head` closed stdout early: not an error of ours
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
