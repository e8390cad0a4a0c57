"""The errors raypack raises about a user's input: one base class, importing nothing from raypack.

An `InputError` means running again fails the same way: a config value, a data source, a
tokenizer or a model raypack can't use. The command line prints it as one line (exit code 2) and
Ray Train never retries it. Every error about the user's input derives from it. The kinds raised
across modules live here (`UnsupportedModelError`: model/traits.py decides, and attention,
the mixers, checkpointing and kernels refuse at run time); a kind one module raises lives there
(`TokenizeError` in data/encode.py, ...), importing this module only.
"""

from __future__ import annotations


class InputError(ValueError):
    """Input raypack can't use; reported as one line and never retried."""


class ConfigError(InputError):
    """A config value is unknown, of the wrong type or out of range, or a command-line argument is."""


class SourceError(InputError):
    """A source file or row is unreadable or invalid; the message names the file and the row."""


class StorageError(InputError):
    """A storage URI that can't be reached (no such bucket, no network, no credentials)."""


class UnsupportedModelError(InputError):
    """The model cannot train exactly on packed rows (with this backend); padded strategies still work."""
