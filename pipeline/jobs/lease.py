"""One writer per output (docs/design.md §8): a job that writes takes the output's lease,
`<output>/.lease.json`, before it touches anything there, and a second run on the output fails
at once, naming the holder.

The lease is created with a put-if-absent (`pipeline.common.conditional`), says who holds it
and until when, and is renewed while an attached run goes on; the job's commit checks that it
still holds it and, for a detached job (whose driver has left), releases it. An expired lease,
or one whose holder on this host is no longer running, is taken over with a warning.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from pipeline.common import conditional, fileio
from pipeline.common.errors import StageError

log = logging.getLogger("ratrain")

LEASE_FILE = ".lease.json"
ATTACHED_SECONDS = 120.0  # an attached run renews its lease every third of this
DETACHED_SECONDS = 24 * 3600.0  # a detached job's lease lasts until its commit releases it, or this long


@dataclass(frozen=True)
class Claim:
    """What a job's commit step knows of its lease: which output, the token it was taken with,
    and whether the commit releases it (a detached job, whose driver has left)."""

    output: str
    token: str
    released_by_commit: bool


class LeaseHeld(StageError):
    """Another run holds the output's lease."""


def lease_path(output: str) -> str:
    return fileio.join(output, LEASE_FILE)


@dataclass(frozen=True, kw_only=True)
class Holder:
    """What a lease says of the run holding it."""

    job: str
    user: str
    host: str
    pid: int
    token: str  # this taking of the lease: what its renewals, commit and release check
    started: float  # seconds since the epoch
    expires: float
    detached: bool = False  # a submitted job's: its submitting process ends at once, the job goes on

    @classmethod
    def new(cls, job: str, seconds: float, detached: bool = False) -> Holder:
        now = time.time()
        return cls(
            job=job,
            user=getpass.getuser(),
            host=socket.gethostname(),
            pid=os.getpid(),
            token=uuid.uuid4().hex,
            started=now,
            expires=now + seconds,
            detached=detached,
        )

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The holder a lease file names; None for one that is not a lease (taken over)."""
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    def gone(self, now: float) -> str | None:
        """Why this lease may be taken over (expired, or its process on this host has ended), or None."""
        if self.expires <= now:
            return f"expired at {_utc(self.expires)}"
        if not self.detached and self.host == socket.gethostname() and not _running(self.pid):
            return f"process {self.pid} on this host has ended"
        return None

    def describe(self) -> str:
        return (
            f"{self.job} (pid {self.pid} on {self.host}, user {self.user}), started {_utc(self.started)}, "
            f"lease until {_utc(self.expires)}"
        )


_HELD_HERE: dict[str, Lease] = {}  # output -> the lease this process holds on it


class Lease:
    """The output's lease, held by this process: `take` it, `keep` it renewed (attached runs),
    `release` it. A command that runs several jobs on one output (`run`) holds it across them:
    each job finds it `held_here`."""

    def __init__(self, output: str, holder: Holder, seconds: float):
        self.output, self.path, self.holder, self.seconds = output, lease_path(output), holder, seconds
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @classmethod
    def take(cls, output: str, job: str, *, seconds: float, detached: bool = False) -> Lease:
        """The lease of `output` for `job`; LeaseHeld, naming the holder, when another run has it.
        `detached`: for a submitted job, which holds it past this process, until it expires."""
        path = lease_path(output)
        mine = Holder.new(job, seconds, detached)
        for _ in range(5):  # the lease changing hands between our reads: look again
            if conditional.create_exclusive(path, mine.to_bytes()):
                return cls._held(output, mine, seconds)
            found = conditional.read_versioned(path)
            if found is None:
                continue  # released meanwhile
            data, version = found
            other = Holder.parse(data)
            why = "not a lease file" if other is None else other.gone(time.time())
            if other is not None and why is None:
                raise LeaseHeld(
                    f"{output} is being written by {other.describe()}: one run per output at a time. If that run "
                    f"is gone, wait for its lease to expire or delete {path}"
                )
            if conditional.replace_if_unchanged(path, mine.to_bytes(), version):
                log.warning("%s: took over the lease of %s (%s)", output, other.describe() if other else path, why)
                return cls._held(output, mine, seconds)
        raise LeaseHeld(f"{output}: its lease changed hands five times while this run tried to take it")

    @classmethod
    def _held(cls, output: str, holder: Holder, seconds: float) -> Lease:
        lease = _HELD_HERE[output] = cls(output, holder, seconds)
        return lease

    @staticmethod
    def held_here(output: str) -> Lease | None:
        """The lease this process holds on `output`, if it holds one."""
        return _HELD_HERE.get(output)

    def __enter__(self) -> Lease:
        self.keep()
        return self

    def __exit__(self, *_) -> None:
        self.release()

    def keep(self) -> None:
        """Renew the lease every third of its length until `release` (a daemon thread)."""

        def renew_until_stopped():
            while not self._stop.wait(self.seconds / 3):
                self.renew()

        self._renewer = threading.Thread(target=renew_until_stopped, name="lease-renewal", daemon=True)
        self._renewer.start()

    def renew(self) -> bool:
        """Move the lease's expiry on; False (and an error logged) when another run took it over."""
        current, version = _current(self.output)
        if current is None or version is None or current.token != self.holder.token:
            log.error(
                "%s: this run's lease was taken over by %s", self.output, current.describe() if current else "nobody"
            )
            return False
        renewed = Holder(**{**asdict(self.holder), "expires": time.time() + self.seconds})
        if not conditional.replace_if_unchanged(self.path, renewed.to_bytes(), version):
            return False
        self.holder = renewed
        return True

    def hand_over(self) -> None:
        """Leave the lease to the submitted job (its commit releases it): no longer this process's."""
        _HELD_HERE.pop(self.output, None)

    def release(self) -> None:
        """Stop renewing and delete the lease, if it is still this run's."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        _HELD_HERE.pop(self.output, None)
        release(self.output, self.holder.token)


def check_held(output: str, token: str) -> None:
    """Before a commit: a StageError unless the lease of `output` is still the one `token` took."""
    current, _ = _current(output)
    if current is None or current.token != token:
        raise StageError(
            f"{output}: this job no longer holds the output's lease "
            f"({'taken over by ' + current.describe() if current else 'it is gone'}); nothing was committed"
        )


def release(output: str, token: str) -> None:
    """Delete the lease of `output` if `token` took it (a detached job's commit does, on a worker)."""
    current, version = _current(output)
    if current is not None and version is not None and current.token == token:
        conditional.delete_if_unchanged(lease_path(output), version)


def _current(output: str) -> tuple[Holder | None, conditional.Version | None]:
    """The holder the lease of `output` names now and the version of the file that says so."""
    found = conditional.read_versioned(lease_path(output))
    return (None, None) if found is None else (Holder.parse(found[0]), found[1])


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # running, as another user
        return True
    return True


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")
