"""Exceptions shared across layers. Each names what is wrong so a user can fix it without a traceback."""


class StructgenError(Exception):
    """Base class of every error structgen raises on purpose."""


class ModelLoadError(StructgenError, ValueError):
    """A checkpoint cannot be loaded: unsupported architecture, missing file, wrong tensor shape..."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture is not one of the supported model families."""
