"""Joining or starting Ray (stage_runtime.placement.ray_session), with ``ray.init`` faked: which
thread starts and stops an instance, and which addresses are refused before Ray sees them."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("ray")

from stage_runtime.errors import ConfigError
from stage_runtime.placement import RayPlacement
from stage_runtime.placement.ray_session import _RayOwner, ray_session


class FakeRay:
    """``ray.init`` / ``ray.shutdown`` / ``ray.is_initialized``, noting the thread of each."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.initialized = False
        self.starting: threading.Event | None = None
        """When set: init waits for it (a slow start, to interrupt)."""
        self.calls: list[tuple[str, threading.Thread]] = []
        self.addresses: list[str | None] = []

    def init(self, **kwargs: Any) -> None:
        self.calls.append(("init", threading.current_thread()))
        self.addresses.append(kwargs.get("address"))
        if self.starting is not None:
            self.starting.wait()
        if self.fail is not None:
            raise self.fail
        self.initialized = True

    def shutdown(self) -> None:
        self.calls.append(("shutdown", threading.current_thread()))
        self.initialized = False

    def is_initialized(self) -> bool:
        return self.initialized


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    fake = FakeRay()
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "init", fake.init)
    monkeypatch.setattr(ray, "shutdown", fake.shutdown)
    monkeypatch.setattr(ray, "is_initialized", fake.is_initialized)
    return fake


async def test_ray_started_from_a_worker_thread_lives_on_a_thread_of_its_own(
    fake_ray: FakeRay,
) -> None:
    """Entered from a trio worker thread (as a pipeline opens), the instance is started on a
    dedicated thread that outlives the worker (a local instance's processes die with the thread
    that started them) and is stopped from that same thread by the last session, which ends it."""
    first, second = ray_session(RayPlacement()), ray_session(RayPlacement())
    assert await trio.to_thread.run_sync(first.__enter__) is True
    assert await trio.to_thread.run_sync(second.__enter__) is True  # shares the instance
    ((what, owner),) = fake_ray.calls
    assert what == "init"
    assert owner.name == "stage-runtime-ray"
    assert owner.is_alive()
    assert owner is not threading.main_thread()
    await trio.to_thread.run_sync(first.__exit__, None, None, None)
    assert owner.is_alive()  # the second session still uses it
    await trio.to_thread.run_sync(second.__exit__, None, None, None)
    assert fake_ray.calls == [("init", owner), ("shutdown", owner)]
    assert not owner.is_alive()


def test_a_process_already_connected_is_left_alone(fake_ray: FakeRay) -> None:
    """With Ray initialised by someone else, a session neither starts nor shuts it down."""
    fake_ray.initialized = True
    with ray_session(RayPlacement()) as connected:
        assert connected is False
    assert fake_ray.calls == []
    assert fake_ray.initialized


def test_ray_that_cannot_start_is_a_config_error_and_leaves_no_thread(
    fake_ray: FakeRay,
) -> None:
    """What ``ray.init`` raises reaches the caller as a ConfigError naming the address; the
    owner thread has ended, and a later session starts afresh."""
    fake_ray.fail = ConnectionError("no cluster here")
    with (
        pytest.raises(ConfigError, match="cannot start or join Ray at address 'auto'"),
        ray_session(RayPlacement(address="auto")),
    ):
        pytest.fail("the session must not open")
    ((_, owner),) = fake_ray.calls
    assert not owner.is_alive()
    fake_ray.fail = None
    with ray_session(RayPlacement()) as connected:
        assert connected is True
    assert [what for what, _ in fake_ray.calls] == ["init", "init", "shutdown"]


def _closed_port() -> int:
    """A port on this host that nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_an_address_nothing_answers_at_is_refused_at_once(fake_ray: FakeRay, scheme: str) -> None:
    """``ray.init`` would retry such an address for minutes: a ConfigError names it first."""
    address = f"{scheme}127.0.0.1:{_closed_port()}"
    with (
        pytest.raises(ConfigError, match=f"cannot reach Ray at address '{address}'"),
        ray_session(RayPlacement(address=address)),
    ):
        pytest.fail("the session must not open")
    assert fake_ray.calls == []


def test_an_address_that_answers_is_handed_to_ray(fake_ray: FakeRay) -> None:
    """A listening host:port passes the check and goes to ``ray.init``."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        with ray_session(RayPlacement(address=address)) as connected:
            assert connected is True
    assert [what for what, _ in fake_ray.calls] == ["init", "shutdown"]


def test_no_address_starts_an_instance_of_its_own(
    fake_ray: FakeRay, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray, given no address, joins the cluster `ray start` last recorded on the host, and
    waits forever when that cluster has died since (its file outlives it). A placement with no
    address starts an instance of its own, as documented: Ray is asked for "local"."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")  # a dead cluster
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    with ray_session(RayPlacement()) as connected:
        assert connected is True
    assert fake_ray.addresses == ["local"]


def test_an_interrupted_start_shuts_down_what_it_was_starting(
    fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """^C while ``ray.init`` runs (the waiting thread interrupted) leaves no instance behind
    that no session owns: the owner thread shuts it down once it has started."""
    fake_ray.starting = threading.Event()
    owner = _RayOwner(None, {})

    def interrupted(timeout: float | None = None) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(owner._ready, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        owner.start()
    fake_ray.starting.set()  # ray.init finishes after the caller gave up
    owner.thread.join(timeout=10)
    assert not owner.thread.is_alive()
    assert [what for what, _ in fake_ray.calls] == ["init", "shutdown"]
    assert not fake_ray.initialized


@pytest.mark.parametrize("address", ["::1", "fe80::1", "[::1]", "no-port-here"])
def test_an_address_without_a_port_is_left_to_ray(fake_ray: FakeRay, address: str) -> None:
    """Nothing to connect to: Ray judges it (here, the fake accepts it)."""
    with ray_session(RayPlacement(address=address)) as connected:
        assert connected is True
    assert [what for what, _ in fake_ray.calls] == ["init", "shutdown"]


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_a_port_out_of_range_is_refused(fake_ray: FakeRay, port: str) -> None:
    with pytest.raises(ConfigError, match=f"port {port} is out of range"):
        _ = ray_session(RayPlacement(address=f"127.0.0.1:{port}")).__enter__()
    assert fake_ray.calls == []
