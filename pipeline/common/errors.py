"""The error every stage and job raises for a run that cannot go on; the commands print it as one
line."""


class StageError(RuntimeError):
    """A stage that cannot run on what it was given (e.g. no committed index), or whose job
    rejected more of its input than it may (nothing is committed)."""


class ChecksumMismatch(StageError):
    """A committed file whose bytes are not those its manifest signed: changed or damaged since,
    refused before anything parses it."""
