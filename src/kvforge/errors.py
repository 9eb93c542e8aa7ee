"""User-facing errors.

A `KvforgeError` is bad input or a missing resource the user can fix: the CLI prints its
message on one line and exits with code 2; the server answers HTTP 400. Anything else is a bug
and keeps its traceback.
"""


class KvforgeError(Exception):
    """Bad input or a missing resource, with a one-line message that names what is wrong."""


class UnknownModelError(KvforgeError):
    """An alias, directory or hub id that cannot be resolved to a model."""


class MissingPackageError(KvforgeError):
    """A packaged model or data set whose PyPI package is not installed."""


class PromptError(KvforgeError):
    """An empty prompt, or one longer than the model's context."""


class DeviceError(KvforgeError):
    """A device that torch cannot see (no CUDA GPU, no such GPU index, no MPS)."""


class ArtifactError(KvforgeError):
    """A saved artifact (cache, map, translator) that is corrupt or belongs to another model."""
