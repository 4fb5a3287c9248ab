"""The pytest plugin ``stage_runtime.testing``, exercised in fresh pytest runs (pytester)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest_plugins = ["pytester"]

TRIO_INI = "[pytest]\ntrio_mode = true\n"


def test_plugin_is_registered_as_a_pytest11_entry_point() -> None:
    """Installing the package registers stage_runtime.testing with pytest."""
    plugins = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert plugins.get("stage_runtime.testing") == "stage_runtime.testing"


def test_listing_the_plugin_in_pytest_plugins_as_well_is_harmless(
    pytester: pytest.Pytester,
) -> None:
    """A conftest naming the plugin explicitly does not register it a second time."""
    pytester.makeconftest('pytest_plugins = ["stage_runtime.testing"]\n')
    pytester.makepyfile(
        test_explicit="""
        def test_fixture_available(stage_config):
            assert stage_config.stage_id == "stage-0"
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_plugin_can_be_disabled_by_name(pytester: pytest.Pytester) -> None:
    """`-p no:stage_runtime.testing` turns the fixtures off."""
    pytester.makepyfile(
        test_disabled="""
        def test_fixture_missing(stage_config):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:stage_runtime.testing")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'stage_config' not found*"])


def test_fixtures_work_in_a_fresh_project_without_conftest(pytester: pytest.Pytester) -> None:
    """A user's own async tests get the fixtures with no conftest and no imports."""
    pytester.makeini(TRIO_INI)
    pytester.makepyfile(
        test_user="""
        from stage_runtime.cache_actor import CacheStatsRequest

        def test_stage_config_is_valid(stage_config):
            assert stage_config.kv_cache is not None
            assert stage_config.layer_end > stage_config.layer_start

        async def test_second_prefill_is_restored(pipeline, capture_stage_logs):
            tokens = list(range(64))
            first = await pipeline.prefill(tokens, session_id="a")
            second = await pipeline.prefill(tokens, session_id="a")
            assert len(second.stages) == 2
            assert all(stage.restored_tokens == 0 for stage in first.stages)
            assert all(stage.restored_tokens > 0 for stage in second.stages)
            restored = [e for e in capture_stage_logs if e["event"] == "activation_restored"]
            assert {e["stage"] for e in restored} == {"stage-0", "stage-1"}

        async def test_cache_actor_answers_stats(cache_actor):
            stats = await cache_actor.ask(CacheStatsRequest())
            assert stats.entries == 0
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


def test_pipeline_fixture_is_drained_after_each_test(pytester: pytest.Pytester) -> None:
    """The pipeline a test used is stopped (draining) once the test is over."""
    pytester.makeini(TRIO_INI)
    pytester.makepyfile(
        test_teardown="""
        seen = []

        async def test_uses_pipeline(pipeline):
            assert not pipeline.draining
            seen.append(pipeline)

        def test_previous_pipeline_was_stopped():
            assert seen and seen[0].draining
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2)


def test_project_conftest_can_override_stage_config(pytester: pytest.Pytester) -> None:
    """A project's own stage_config fixture wins, and pipeline/cache_actor are built from it."""
    pytester.makeini(TRIO_INI)
    pytester.makeconftest(
        """
        import attrs
        import pytest
        from stage_runtime.config import CacheMode, KvCacheConfig, StageConfig

        @pytest.fixture
        def stage_config():
            return StageConfig(
                stage_id="mine",
                model_id="my/model",
                layer_start=0,
                layer_end=2,
                kv_cache=KvCacheConfig(mode=CacheMode.DISABLED),
            )
        """
    )
    pytester.makepyfile(
        test_override="""
        async def test_cache_is_off(pipeline, stage_config):
            assert stage_config.stage_id == "mine"
            tokens = list(range(80))
            await pipeline.prefill(tokens, session_id="a")
            again = await pipeline.prefill(tokens, session_id="a")
            assert all(stage.restored_tokens == 0 for stage in again.stages)
            assert [c.layer_end for c in pipeline.stage_configs] == [2, 4]
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_capture_stage_logs_keeps_contextvars_bound_keys(pytester: pytest.Pytester) -> None:
    """Keys bound with structlog.contextvars appear in captured events."""
    pytester.makeini(TRIO_INI)
    pytester.makepyfile(
        test_logs="""
        import structlog

        def test_bound_key_is_kept(capture_stage_logs):
            with structlog.contextvars.bound_contextvars(stage="s-7"):
                structlog.get_logger("user").info("thing_happened", size_bytes=3)
            assert capture_stage_logs == [
                {"stage": "s-7", "event": "thing_happened", "size_bytes": 3, "log_level": "info"}
            ]
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_capture_stage_logs_is_isolated_from_earlier_tests_and_log_levels(
    pytester: pytest.Pytester,
) -> None:
    """Keys an earlier test bound and never unbound stay out of a later test's events, and
    debug events are captured though the program filters its loggers at info (the README
    example asserts on the debug event activation_restored)."""
    pytester.makeini(TRIO_INI)
    pytester.makeconftest(
        """
        import logging
        import structlog

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
        """
    )
    pytester.makepyfile(
        test_logs="""
        import structlog

        def test_a_binds_and_forgets():
            structlog.contextvars.bind_contextvars(request_id="from-test-a")

        def test_b_sees_only_its_own_keys(capture_stage_logs):
            structlog.get_logger("user").debug("hello")
            assert capture_stage_logs == [{"event": "hello", "log_level": "debug"}]

        def test_c_earlier_bindings_are_back():
            assert structlog.contextvars.get_contextvars() == {"request_id": "from-test-a"}

        async def test_readme_example(pipeline, capture_stage_logs):
            tokens = list(range(64))
            await pipeline.prefill(tokens, session_id="a")
            result = await pipeline.prefill(tokens, session_id="a")
            assert all(stage.restored_tokens > 0 for stage in result.stages)
            assert any(e["event"] == "activation_restored" for e in capture_stage_logs)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=4)


def test_plugin_does_not_import_the_http_server() -> None:
    """Loading the plugin pulls in neither hypercorn nor the server package."""
    code = (
        "import sys, stage_runtime.testing; "
        "print('hypercorn' in sys.modules, 'stage_runtime.server' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.split() == ["False", "False"]
