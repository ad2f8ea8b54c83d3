"""Pydantic's validation errors as one line a user reads (the CLI prints no tracebacks)."""

from pydantic import ValidationError


def one_line(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}{e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )
