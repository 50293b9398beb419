"""The store's exceptions: every message names the URI it is about."""
from __future__ import annotations

class ArtifactError(RuntimeError):
    """Base class for store errors; the message always names the URI."""


class NotCommittedError(ArtifactError):
    pass


class StageMismatchError(ArtifactError):
    pass


class StoreUnreachableError(ArtifactError):
    pass


class ForeignFilesError(ArtifactError):
    """The output prefix holds files this project did not write: they are never touched."""
