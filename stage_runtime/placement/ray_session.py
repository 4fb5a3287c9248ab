"""Joining or starting Ray for one pipeline or one fanned-out simulation, and leaving it as found.

Import this module only where Ray is installed (``stage-runtime[ray]``);
:class:`~stage_runtime.placement.RayPlacement` checks that before anything gets here.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, ParamSpec, TypeVar

import ray

from stage_runtime.errors import ConfigError
from stage_runtime.placement import RayPlacement

__all__ = ["RayExecutor", "open_ray_executor", "ray_session"]

_P = ParamSpec("_P")
_T = TypeVar("_T")

# ray.init and ray.shutdown act on process-wide state; two pipelines opening at once in worker
# threads must not both decide to start an instance.
_session_lock = threading.Lock()
_sessions = 0
"""Open sessions of this process that share the Ray instance the first one started."""
_owner: _RayOwner | None = None
"""The thread that started (or joined) that instance, which the last session stops."""


class _RayOwner:
    """A thread that calls ``ray.init``, stays until asked to leave, then calls
    ``ray.shutdown``.

    A local instance's processes (GCS, raylet) are started with ``PR_SET_PDEATHSIG`` on Linux:
    they are killed when the *thread* that started them ends, not only the process. A trio
    worker thread ends after 10 idle seconds, so ``ray.init`` runs on a thread of its own that
    lives as long as the instance (a daemon: if the process exits without closing, the
    instance goes with it, as Ray intends).
    """

    def __init__(self, address: str | None, options: dict[str, Any]) -> None:
        self._address = address
        self._options = options
        self._ready = threading.Event()
        self._leave = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="stage-runtime-ray", daemon=True)

    @property
    def thread(self) -> threading.Thread:
        """The thread that started Ray (alive while the instance is)."""
        return self._thread

    def start(self) -> None:
        """Start or join Ray; blocks until done, raising what ``ray.init`` raised. Interrupted
        (^C), it leaves the thread to shut down what ``ray.init`` is still starting."""
        self._thread.start()
        try:
            self._ready.wait()
        except BaseException:
            self._leave.set()
            raise
        if self._error is not None:
            self._thread.join()
            raise self._error

    def stop(self) -> None:
        """Shut Ray down (from the owner thread) and wait for the thread to end."""
        self._leave.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            ray.init(address=self._address, **self._options)
        except BaseException as exc:  # handed to start(), in the caller's thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._leave.wait()
        ray.shutdown()


@contextmanager
def ray_session(placement: RayPlacement) -> Iterator[bool]:
    """Make sure this process is connected to Ray for the block; yields whether it connected.

    When the process is already connected (its own ``ray.init``, a test fixture's), that
    connection is used and left alone. Otherwise ``ray.init(address=placement.address,
    **placement.init_options)`` starts a local instance (``address=None``, given to Ray as
    ``"local"``: a new instance even when ``ray start`` recorded a cluster) or joins a cluster,
    on a thread that lives until the last session ends (see :class:`_RayOwner`); that session
    calls ``ray.shutdown()``, which stops an instance the session started and only disconnects
    from one it joined.

    Raises:
        ConfigError: Ray could not start or join (a wrong address, say); names the address.
    """
    global _sessions, _owner
    with _session_lock:
        if _sessions == 0 and not ray.is_initialized():
            _check_reachable(placement.address)
            options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            options.update(placement.init_options)
            # None starts an instance of this pipeline's own, as documented: "local" says so
            # to Ray, which would otherwise join the last cluster `ray start` recorded on this
            # host, and wait forever when that cluster has since died (its file outlives it).
            address = "local" if placement.address is None else placement.address
            owner = _RayOwner(address, options)
            try:
                owner.start()
            except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:
                msg = f"cannot start or join Ray at address {placement.address!r}: {exc}"
                raise ConfigError(msg) from exc
            _owner = owner
        _sessions += 1
        connected_here = _owner is not None
    try:
        yield connected_here
    finally:
        with _session_lock:
            _sessions -= 1
            if _sessions == 0 and _owner is not None:
                owner, _owner = _owner, None
                owner.stop()


REACH_TIMEOUT_S: Final = 5.0
"""How long :func:`ray_session` waits for a TCP connection to a ``host:port`` address."""


def _check_reachable(address: str | None) -> None:
    """Refuse an address nothing answers at: ``ray.init`` would retry it for minutes.

    ``None`` (start an instance) and ``"auto"`` (Ray finds the local cluster, or says at once
    that there is none) are left to Ray, as is an address without a port.

    Raises:
        ConfigError: nothing accepts a TCP connection at the address's host and port.
    """
    if address is None or address == "auto":
        return
    where = address.removeprefix("ray://")
    host, colon, port = where.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")  # an IPv6 host with a port
    if not colon or not port.isdigit() or (":" in host and not bracketed):
        return  # no port (a bare IPv6 address is all colons)
    if not 0 < int(port) <= 65535:
        msg = f"cannot reach Ray at address {address!r}: port {port} is out of range"
        raise ConfigError(msg)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except (OSError, ValueError) as exc:
        msg = f"cannot reach Ray at address {address!r}: {str(exc) or type(exc).__name__}"
        raise ConfigError(msg) from exc


class RayExecutor(concurrent.futures.Executor):
    """A :class:`concurrent.futures.Executor` that runs each call as a Ray task.

    Each task reserves ``placement.num_cpus`` logical CPUs (one when None). An argument passed
    to several calls (the same object) is put in Ray's object store once and shared by
    reference.
    """

    def __init__(self, placement: RayPlacement) -> None:
        self._placement = placement
        self._remotes: dict[Callable[..., Any], Any] = {}
        self._refs: dict[int, tuple[object, ray.ObjectRef[Any]]] = {}
        self._shutdown = False

    def submit(
        self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> concurrent.futures.Future[_T]:
        if self._shutdown:
            msg = "cannot submit to a RayExecutor after shutdown"
            raise RuntimeError(msg)
        remote = self._remotes.get(fn)
        if remote is None:
            # A unit of work keeps a core busy: one CPU each unless the placement says.
            cpus = self._placement.num_cpus
            remote = ray.remote(num_cpus=1 if cpus is None else cpus)(fn)
            self._remotes[fn] = remote
        refs = [self._shared(arg) for arg in args]
        future: concurrent.futures.Future[_T] = remote.remote(*refs, **kwargs).future()
        return future

    def _shared(self, value: object) -> object:
        """``value``'s object-store reference when it is big enough to be worth sharing."""
        if isinstance(value, int | float | str | bool | type(None)):
            return value
        held = self._refs.get(id(value))
        if held is None:
            # The value itself is kept next to its ref, so its id cannot be reused meanwhile.
            held = (value, ray.put(value))
            self._refs[id(value)] = held
        return held[1]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        self._refs.clear()


@contextmanager
def open_ray_executor(placement: RayPlacement) -> Iterator[RayExecutor]:
    """A :class:`RayExecutor` inside a :func:`ray_session` (Ray started or joined for the block).

    Raises:
        ConfigError: Ray could not start or join.
    """
    with ray_session(placement):
        executor = RayExecutor(placement)
        try:
            yield executor
        finally:
            executor.shutdown()
