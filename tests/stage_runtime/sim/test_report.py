"""Reports: the JSON keys programs depend on, the tables people read, the plot."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from matplotlib.patches import Rectangle
from rich.console import Console

from stage_runtime import ConfigError
from stage_runtime.accounting import CacheAccounting
from stage_runtime.sim import (
    CostModel,
    Percentiles,
    ReplayResult,
    SimConfig,
    SimRequest,
    TheoreticalMax,
    plot_figure,
    render_report,
    render_sweep,
    result_to_json,
    run_replay,
    run_sweep,
    sweep_order,
    write_plot,
)

TRACE = [
    SimRequest(index=0, input_length=40, block_ids=(1, 2, 3)),
    SimRequest(index=1, input_length=40, block_ids=(1, 2, 4)),
]
CONFIG = SimConfig(
    stages=2, block_size=16, bytes_per_token=2, cost=CostModel(prefill_s_per_token=1e-3)
)


@pytest.fixture(scope="module")
def result() -> ReplayResult:
    """One small replay shared by the report tests."""
    return run_replay(TRACE, CONFIG)


def test_json_has_the_stable_keys(result: ReplayResult) -> None:
    """The issue's keys are all there, with the values of the replay, and it round-trips."""
    document = result_to_json(result, source={"kind": "trace", "path": "t.jsonl"})
    assert {
        "requests",
        "prompt_tokens",
        "restored_tokens",
        "token_hit_ratio",
        "theoretical_max_hit_ratio",
        "stages",
        "ttft_s",
        "wall_s",
        "tokens_per_s",
        "config",
    } <= set(document)
    assert (document["requests"], document["prompt_tokens"], document["restored_tokens"]) == (
        2,
        80,
        32,
    )
    stages = document["stages"]
    assert isinstance(stages, list)
    assert len(stages) == 2
    assert {
        "stage_id",
        "restored_tokens",
        "computed_tokens",
        "records",
        "evictions",
        "resident_bytes_max",
        "misses",
        "resident_bytes",
        "unique_prefix_bytes",
        "residency_ratio",
    } <= set(stages[0])
    assert stages[0]["misses"] == {"never_seen": 1, "evicted": 0, "rejected": 0}
    ttft = document["ttft_s"]
    assert isinstance(ttft, dict)
    assert set(ttft) == {"p50", "p90", "p99"}
    assert set(ttft["p99"]) == {"cached", "uncached"}
    config = document["config"]
    assert isinstance(config, dict)
    assert config["min_tokens"] == 16
    assert config["stride_tokens"] == config["effective_stride_tokens"] == 16
    assert config["source"] == {"kind": "trace", "path": "t.jsonl"}
    assert json.loads(json.dumps(document)) == document


def test_report_shows_ratios_stages_and_ttft(result: ReplayResult) -> None:
    """The human report names the totals, every stage and the TTFT percentiles."""
    console = Console(record=True, width=140)
    render_report(console, result, title="test replay", skipped_lines=3)
    text = console.export_text()
    for fragment in (
        "test replay",
        "token hit ratio",
        "40.0%",
        "theoretical max",
        "stage-1",
        "skipped bad lines",
        "p99",
        "without cache",
        "tokens/s",
    ):
        assert fragment in text


def _report(result: ReplayResult) -> str:
    console = Console(record=True, width=300)
    render_report(console, result, title="replay")
    return console.export_text()


def test_concurrent_report_shows_the_load_and_says_when_requests_queue() -> None:
    """At concurrency 2 the report gives the busiest stage's load and the queueing share, and
    explains an overloaded pipeline; one request at a time it shows neither (JSON: null)."""
    trace = [
        SimRequest(index=0, input_length=40, block_ids=(1, 2, 3), arrival_s=0.0),
        SimRequest(index=1, input_length=16, block_ids=(7,), arrival_s=0.01),
    ]
    loaded = run_replay(trace, attrs.evolve(CONFIG, concurrency=2))
    text = _report(loaded)
    assert "2.80 with cache, 2.80 without" in text  # worked by hand in test_replay
    assert "33% (with cache)" in text  # 54 of 166 ms of TTFT
    assert "it cannot keep up, so requests queue: 33% of all time to first token" in text
    document = result_to_json(loaded)
    assert document["offered_load"] == pytest.approx({"cached": 2.8, "uncached": 2.8})
    assert document["ttft_waiting_share"] == pytest.approx(0.054 / 0.166)
    assert document["arrival_span_s"] == pytest.approx(0.01)
    # Arrivals 100 s apart: the stages idle most of the time, nothing is said about queues.
    idle = [attrs.evolve(trace[1], arrival_s=100.0), trace[0]]
    text = _report(run_replay(idle, attrs.evolve(CONFIG, concurrency=2)))
    assert "0.00 with cache, 0.00 without" in text
    assert "0% (with cache)" in text
    assert "queues." not in text
    one_at_a_time = run_replay(trace, CONFIG)
    text = _report(one_at_a_time)
    assert "busiest stage" not in text
    assert "queue" not in text
    document = result_to_json(one_at_a_time)
    assert document["offered_load"] is None
    assert document["ttft_waiting_share"] is None


def test_report_tells_a_cache_that_saves_the_stages_from_one_that_cannot_keep_up() -> None:
    """Under load 1 with the cache and over it without, the report says the cache made the
    difference; under 1 both ways but with most of the TTFT in queues, it blames bursts."""
    same = [
        SimRequest(index=i, input_length=40, block_ids=(1, 2, 3), arrival_s=i * 0.03)
        for i in range(4)
    ]
    # Without the cache each stage has 4 x 40 ms for 3 gaps of 30 ms: load 160 x 3/4 / 90 =
    # 1.33. With it the repeats restore all 40 tokens (nearly free): 40 x 3/4 / 90 = 0.33.
    saved = run_replay(same, attrs.evolve(CONFIG, concurrency=2))
    load = saved.offered_load
    assert load is not None
    assert [load.cached, load.uncached] == pytest.approx([1 / 3, 4 / 3], rel=1e-3)
    assert "Without the cache the busiest stage could not keep up with these arrivals (load " in (
        _report(saved)
    )
    # Eight 16-token prompts at once, then one 10 s later: load 0.01, but the burst's j-th prompt
    # finishes at (j + 2) x 16 ms, so 28 of 46 x 16 ms of TTFT are queueing (61%).
    burst = [
        SimRequest(index=i, input_length=16, block_ids=(10 + i,), arrival_s=0.0) for i in range(8)
    ]
    burst.append(SimRequest(index=8, input_length=16, block_ids=(99,), arrival_s=10.0))
    bursty = run_replay(burst, attrs.evolve(CONFIG, concurrency=8))
    assert bursty.waiting_share == pytest.approx(28 / 46)
    assert "keeps up on average (load 0.01 with the cache), but arrivals come in bursts" in (
        _report(bursty)
    )
    assert "61% of all time to first token (with the cache) is spent in queues" in _report(bursty)


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_report_shows_misses_by_reason_and_resident_vs_unique_bytes(index: str) -> None:
    """A prompt pushed out by another misses as 'evicted'; JSON and table show the footprint."""
    # 40 tokens: ladder rungs 40 and 32 (2 entries); paged: 2 pages of 16 and a tail (3).
    config = attrs.evolve(CONFIG, index=index, max_entries=2 if index == "ladder" else 3)
    trace = [
        SimRequest(index=0, input_length=40, block_ids=(1, 2, 3)),
        SimRequest(index=1, input_length=40, block_ids=(7, 8, 9)),
        SimRequest(index=2, input_length=40, block_ids=(1, 2, 3)),
    ]
    result = run_replay(trace, config)
    stages = result_to_json(result)["stages"]
    assert isinstance(stages, list)
    rows = 40 + 32 if index == "ladder" else 40  # what stays resident: the last prompt
    for stage in stages:
        assert stage["misses"] == {"never_seen": 2, "evicted": 1, "rejected": 0}
        assert (stage["resident_bytes"], stage["unique_prefix_bytes"]) == (rows * 2, 40 * 2)
        assert stage["residency_ratio"] == pytest.approx(rows / 40)
    console = Console(record=True, width=140)
    render_report(console, result, title="evictions")
    text = console.export_text()
    assert "misses: never seen" in text
    # stage, hits, never seen, evicted, rejected, resident, unique, ratio
    row = ["stage-0", "0", "2", "1", "0", str(rows * 2), "B", "80", "B", f"{rows / 40:.2f}x"]
    assert row in [line.split() for line in text.splitlines()]


def test_sweep_report_has_a_row_per_capacity() -> None:
    """The sweep table lists each capacity, unbounded included."""
    results = run_sweep(TRACE, CONFIG, [8, 0])
    console = Console(record=True, width=200)
    render_sweep(console, results, title="sweep")
    text = console.export_text()
    rows = [line.split() for line in text.splitlines()]
    assert [row[0] for row in rows if row and row[0] in ("8", "unbounded")] == ["8", "unbounded"]
    assert "capacity (tokens)" in text
    assert "held / unique (stage 0)" in text
    # The settings that bound the sweep besides the capacity (the entry bound first of all).
    assert f"cache per stage: {CONFIG.max_entries} entries, capacity swept (below)" in text
    uncached = results[0].ttft_uncached
    assert f"TTFT without cache: p50 {uncached.p50 * 1000:.1f} ms" in text
    assert " for 2 replays\n" in text
    console = Console(record=True, width=200)
    render_sweep(console, results[:1], title="one capacity")
    assert " for 1 replay\n" in console.export_text()


def test_sweep_report_sorts_capacities_and_lists_evictions_stage_by_stage() -> None:
    """Rows go by increasing capacity with unbounded last; evictions are per stage, not summed."""
    results = run_sweep(TRACE, CONFIG, [0, 40, 8])
    assert [r.capacity_tokens for r in sweep_order(results)] == [8, 40, 0]
    console = Console(record=True, width=200)
    render_sweep(console, results, title="sweep")
    text = console.export_text()
    rows = [line.split() for line in text.splitlines()]
    rows = [row for row in rows if row and row[0] in ("8", "40", "unbounded")]
    assert [row[0] for row in rows] == ["8", "40", "unbounded"]
    smallest = sweep_order(results)[0]
    [evictions] = {stage.evictions for stage in smallest.stages}
    assert evictions > 0
    # capacity, max bytes ("16 B"), hit ratio, evictions: every stage evicted as many, one figure
    assert rows[0][:5] == ["8", "16", "B", "40.0%", str(evictions)]
    # Stages that evicted differently are listed stage by stage.
    uneven = attrs.evolve(
        smallest,
        stages=(smallest.stages[0], attrs.evolve(smallest.stages[1], evictions=evictions + 7)),
    )
    console = Console(record=True, width=200)
    render_sweep(console, [uneven], title="uneven")
    assert f" {evictions}/{evictions + 7} " in console.export_text()


def test_plots_are_png_files(tmp_path: Path, result: ReplayResult) -> None:
    """A single run and a sweep both write PNG files."""
    single, sweep = tmp_path / "single.png", tmp_path / "sweep.png"
    write_plot([result], single)
    write_plot(run_sweep(TRACE, CONFIG, [8, 0]), sweep)
    for path in (single, sweep):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_single_run_plot_counts_tokens_with_thousands_separators(result: ReplayResult) -> None:
    """The per-request plot's token axis reads as the report does (175,000, not 175000)."""
    axes = plot_figure([result]).axes[0]
    assert axes.yaxis.get_major_formatter()(175_000, 0) == "175,000"
    assert all(float(tick).is_integer() for tick in axes.get_yticks())  # whole tokens
    assert all(float(tick).is_integer() for tick in axes.get_xticks())  # whole requests
    bars = [patch.get_height() for patch in axes.patches if isinstance(patch, Rectangle)]
    assert bars[: len(result.outcomes)] == [
        o.input_length - o.restored_tokens[0] for o in result.outcomes
    ]


def test_plot_of_no_results_is_refused() -> None:
    """No replay to plot is a ConfigError naming it, not an IndexError."""
    with pytest.raises(ConfigError, match="results must hold at least one replay, got none"):
        plot_figure([])


def test_sweep_plot_axis_fits_the_ratios_with_room_above() -> None:
    """A sweep's y axis reaches a little above its highest ratio, in percent, not always to 100%."""
    results = run_sweep(TRACE, CONFIG, [8, 0])
    top = max(results[0].theoretical.ratio, *(r.token_hit_ratio for r in results))
    assert 0 < top < 0.8  # the scale below is the data's, not the 0-1 default
    axes = plot_figure(results).axes[0]
    low, high = axes.get_ylim()
    assert low == 0
    assert high == pytest.approx(top * 1.25)
    assert axes.yaxis.get_major_formatter()(0.25, 0) == "25%"
    # Ratios that restored next to nothing still get a readable axis, up to 5%.
    nothing = attrs.evolve(results[0].theoretical, hit_tokens=0)
    flat = [attrs.evolve(r, restored_tokens=0, theoretical=nothing) for r in results]
    assert plot_figure(flat).axes[0].get_ylim() == (0, 0.05)


def _more_misses(accounting: CacheAccounting | None) -> CacheAccounting:
    assert accounting is not None
    return attrs.evolve(accounting, misses_never_seen=2_537, misses_evicted=1_188)


def _big(result: ReplayResult) -> ReplayResult:
    """The result with the figures of a full Mooncake replay (tens of millions of tokens)."""
    stages = tuple(
        attrs.evolve(
            stage,
            restored_tokens=5_663_580,
            computed_tokens=55_531_048,
            records=5_772,
            evictions=5_438,
            resident_bytes_max=16_320_875_520,
            accounting=_more_misses(stage.accounting),
        )
        for stage in result.stages
    )
    return attrs.evolve(
        result, requests=3_993, prompt_tokens=61_194_628, restored_tokens=5_663_580, stages=stages
    )


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_report_tables_keep_every_figure_whole_on_narrow_consoles(
    result: ReplayResult, width: int
) -> None:
    """On an 80-column terminal no figure is cut short ("5,663,..."); headers wrap instead.
    Narrower, the tables are laid out wider than the console and left for the terminal to wrap
    (at 40 columns rich showed "2,07…" and "st…")."""
    big = _big(result)
    console = Console(record=True, width=width)
    render_report(console, big, title="full trace")
    text = console.export_text()
    assert "\u2026" not in text  # rich's ellipsis: something was cropped
    if width >= 80:
        assert max(len(line) for line in text.splitlines()) <= width
    for figure in ("5,663,580", "55,531,048", "5,772", "5,438", "stage-0", "2,537", "1,188"):
        assert figure in text
    assert "15.2 GiB" in text
    sweep = [attrs.evolve(big, capacity_tokens=1_048_576), attrs.evolve(big, capacity_tokens=0)]
    console = Console(record=True, width=width)
    render_sweep(console, sweep, title="sweep")
    text = console.export_text()
    assert "\u2026" not in text
    if width >= 80:
        assert max(len(line) for line in text.splitlines()) <= width
    for figure in ("1,048,576", "5,438", "unbounded", "2.0 MiB", "15.2 GiB"):
        assert figure in text


def test_absurd_times_stay_short(result: ReplayResult) -> None:
    """TTFTs of 1e300 s (absurd costs) print in scientific notation, not 300 digits."""
    huge = attrs.evolve(
        result,
        ttft_cached=Percentiles(p50=9.13e298, p90=1e299, p99=2e299),
        ttft_uncached=Percentiles(p50=1e299, p90=2e299, p99=1.0),
    )
    console = Console(record=True, width=80)
    render_report(console, huge, title="absurd")
    text = console.export_text()
    rows = [line.split() for line in text.splitlines()]
    assert ["p50", "9.13e+298", "s", "1e+299", "s", "9%"] in rows
    assert ["p90", "1e+299", "s", "2e+299", "s", "50%"] in rows
    assert ["p99", "2e+299", "s", "1.00", "s", "<", "-999%"] in rows  # slower with the cache
    assert "\u2026" not in text


@pytest.mark.parametrize(
    ("index", "hint"),
    [
        ("ladder", "Try --index paged"),  # the ladder recorded 64 and 48 tokens, not 32
        ("paged", "Nothing more was there to restore."),  # pages 1 and 2 are shared
    ],
)
def test_closing_line_points_at_what_closes_the_gap(index: str, hint: str) -> None:
    trace = [
        SimRequest(index=0, input_length=64, block_ids=(1, 2, 3, 5)),
        SimRequest(index=1, input_length=40, block_ids=(1, 2, 9)),
    ]
    result = run_replay(trace, attrs.evolve(CONFIG, index=index, min_tokens=16, stride_tokens=16))
    assert result.theoretical.ratio == pytest.approx(32 / 104)
    console = Console(record=True, width=200)
    render_report(console, result, title="hint")
    text = console.export_text()
    assert hint in text
    assert ("Try --index paged" in text) is (index == "ladder")


def test_a_gap_too_small_to_show_is_no_gap() -> None:
    """A gap below what the percentages show (under 0.05 points) is reported as nothing more
    to restore, not as advice to change settings."""
    result = run_replay(TRACE, CONFIG)
    tokens = 100_000
    maximum = TheoreticalMax(hit_tokens=50_000, prompt_tokens=tokens)
    for restored, hint in ((49_960, "Nothing more was there"), (49_000, "closes the gap")):
        shown = attrs.evolve(
            result, prompt_tokens=tokens, restored_tokens=restored, theoretical=maximum
        )
        console = Console(record=True, width=200)
        render_report(console, shown, title="gap")
        assert hint in console.export_text()


def _drawn_at(figure: object, index: float, tokens: float) -> bool:
    """Whether the per-request plot, drawn as write_plot draws it (960x540), colours a pixel
    within half a pixel of request ``index`` at height ``tokens``."""
    import io

    import numpy as np
    from matplotlib.figure import Figure

    assert isinstance(figure, Figure)
    figure.set_dpi(120)
    raw = io.BytesIO()
    figure.savefig(raw, format="rgba", dpi=120)
    width, height = (round(float(side)) for side in figure.get_size_inches() * 120)
    pixels = np.frombuffer(raw.getvalue(), dtype=np.uint8).reshape(height, width, 4)
    x, y = figure.axes[0].transData.transform((index, tokens))
    row = pixels.shape[0] - 1 - round(y)
    columns = pixels[row, max(round(x) - 1, 0) : round(x) + 2, :3]
    return bool((columns < 200).any())  # a bar's colour, not the white background


def test_the_tallest_of_a_thousand_requests_are_drawn_at_960x540(result: ReplayResult) -> None:
    """With 1,000 requests, bars are narrower than a pixel: the two tallest were not drawn at
    all, though the axis reached them (--limit-requests 1000 --plot)."""
    base = result.outcomes[0]
    # The shape of the trace's first 1,000 requests, whose two tallest went missing.
    lengths = [30_000] * 1000
    lengths[249], lengths[189] = 134_773, 82_831
    outcomes = tuple(
        attrs.evolve(
            base, index=i, input_length=n, restored_tokens=(0,) * len(base.restored_tokens)
        )
        for i, n in enumerate(lengths)
    )
    many = attrs.evolve(result, outcomes=outcomes)
    assert _drawn_at(plot_figure([many]), 249, 130_000)
    assert _drawn_at(plot_figure([many]), 189, 80_000)
    assert not _drawn_at(plot_figure([many]), 500, 80_000)  # nothing tall there
