"""The config's one error type: input the user must fix."""
from __future__ import annotations


class UserError(ValueError):
    """Input the user must fix (config, flags, run directory): the command line prints the message alone, exit 2."""


def fail(key: str, message: str):
    """Raise the one-line UserError of config key `key`: "config.KEY: MESSAGE" (the message names the fix)."""
    raise UserError(f"config.{key}: {message}")
