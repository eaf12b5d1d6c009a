"""Request-size limits of ``decode serve``, apart from the HTTP stack so the command line (``decode --help``,
``decode eval``) builds without fastapi installed."""

BODY_BYTES_PER_TOKEN = 64  # a generous bound on the JSON bytes one token of prompt takes (escapes included)
BODY_SLACK = 64 * 1024  # the rest of a request: fields, message wrappers, whitespace


def default_max_body_bytes(context: int) -> int:
    """The default --max-body-bytes: room for a prompt filling the whole context at a generous
    BODY_BYTES_PER_TOKEN, plus BODY_SLACK for the rest of the JSON."""
    return context * BODY_BYTES_PER_TOKEN + BODY_SLACK
