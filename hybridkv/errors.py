"""The one exception type hybridkv raises for bad input; the CLI prints it as one line."""


class HybridKVError(Exception):
    """A problem with what the user asked for (model, cache, budget, lengths), said in one line."""
