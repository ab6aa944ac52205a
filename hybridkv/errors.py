"""Every error a hybridkv user can see derives from HybridKVError; the CLI prints any of them as one line.

The module sits below every other layer (stores, models, methods, CLI all import it), so the whole
hierarchy lives here.
"""


class HybridKVError(Exception):
    """A problem with what the user asked for (model, cache, budget, lengths, store), said in one line."""


class StoreError(HybridKVError):
    """A store backend could not do what was asked.

    `unavailable`: the backend is down or not answering (every operation will fail for a while);
    otherwise it refused this one operation (e.g. it is full) and may still serve others.
    """

    def __init__(self, message: str, unavailable: bool = True) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class CorruptEntry(HybridKVError):
    """Stored bytes are not a valid entry, or not the entry that was asked for."""


class MissingDataError(HybridKVError):
    """A workload task whose data is not there (no --data, or not the files it needs); the message
    says the task is skipped and what it needs, and the arena runs the other tasks."""
