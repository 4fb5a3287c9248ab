"""bench_http measures the HTTP server against in-process prefills and counts lost responses
under load (a few requests: nothing timed).

The script runs in a fresh process: it configures structlog, which would outlive it here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.benchmark_scripts import BENCHMARKS


def test_a_small_run_reports_both_concurrencies_the_load_and_three_goals(tmp_path: Path) -> None:
    """Each concurrency gets in-process and HTTP figures, the load run answers every request,
    and the goals are recorded as run.py reads them; the server process is gone afterwards."""
    out = tmp_path / "http.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_http.py"),
            *("--requests", "6", "--repeat", "1", "--concurrency", "1", "3"),
            *("--load-requests", "30", "--load-concurrency", "10", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text(encoding="utf-8"))
    assert [row["concurrency"] for row in result["runs"]] == [1, 3]
    for row in result["runs"]:
        assert row["http_requests_per_s"] > 0
        assert row["server_cpu_ms_per_request"] >= 0  # /proc counts in ticks of 10 ms
    assert result["load"]["answered_by_status"] == {"200": 30}
    assert result["load"]["lost"] == 0
    # One BLAS thread, set as the script loads (unless this environment had set them already).
    assert result["blas_threads"] == {
        name: os.environ.get(name, "1")
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    }
    names = [goal["name"] for goal in result["goals"]]
    assert len(names) == 3
    assert "responses lost, 30 POSTs at concurrency 10" in names[2]
    assert all(set(goal) == {"name", "target", "measured", "met"} for goal in result["goals"])
    assert "load: 30 POSTs at concurrency 10" in done.stdout
    assert sorted(path.name for path in tmp_path.iterdir()) == ["http.json"]
