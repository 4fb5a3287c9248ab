"""Reports of replays: rich tables for people, stable JSON for programs, a PNG plot."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
from rich import box
from rich.console import Console, JustifyMethod
from rich.table import Table
from rich.text import Text

from stage_runtime.accounting import CacheAccounting
from stage_runtime.config import CacheIndex
from stage_runtime.errors import ConfigError
from stage_runtime.sim.driver import ReplayResult, SimConfig, StageSummary

if TYPE_CHECKING:  # matplotlib is an optional extra
    from matplotlib.figure import Figure

__all__ = [
    "PLOT_FORMATS",
    "plot_figure",
    "plot_format",
    "render_report",
    "render_sweep",
    "result_to_json",
    "sweep_order",
    "write_plot",
]


def result_to_json(
    result: ReplayResult, *, source: Mapping[str, object] | None = None
) -> dict[str, object]:
    """The JSON form of one replay, with the issue's stable keys.

    Args:
        result: The replay.
        source: What was replayed (trace path, workload shape, skipped lines); stored under
            ``config["source"]``.

    Returns:
        A JSON-ready dict: ``requests``, ``prompt_tokens``, ``restored_tokens`` (stage 0),
        ``token_hit_ratio``, ``theoretical_max_hit_ratio``, ``stages`` (``stage_id``,
        ``restored_tokens``, ``computed_tokens``, ``records``, ``evictions``,
        ``resident_bytes_max`` and a few more, among them ``misses`` by reason
        (``never_seen``/``evicted``/``rejected``), ``resident_bytes`` and
        ``unique_prefix_bytes`` at the end, and their ``residency_ratio``), ``ttft_s``
        (``p50``/``p90``/``p99``, each ``cached`` and ``uncached``), ``wall_s``,
        ``tokens_per_s`` and ``config`` (every setting used), plus ``virtual_s``,
        ``theoretical_max_hit_tokens``, ``arrival_span_s``, ``offered_load``
        (``cached``/``uncached``; null when arrivals did not pace the replay, or all came at
        once) and ``ttft_waiting_share`` (null when arrivals did not pace the replay: see
        :attr:`~stage_runtime.sim.driver.ReplayResult.waiting_share`).
    """
    config = result.config.as_dict(result.capacity_tokens)
    if source is not None:
        config["source"] = dict(source)
    ttft = {
        name: {
            "cached": getattr(result.ttft_cached, name),
            "uncached": getattr(result.ttft_uncached, name),
        }
        for name in ("p50", "p90", "p99")
    }
    load = result.offered_load
    return {
        "requests": result.requests,
        "prompt_tokens": result.prompt_tokens,
        "restored_tokens": result.restored_tokens,
        "token_hit_ratio": result.token_hit_ratio,
        "theoretical_max_hit_ratio": result.theoretical.ratio,
        "theoretical_max_hit_tokens": result.theoretical.hit_tokens,
        "clairvoyant_hit_ratio": None if result.clairvoyant is None else result.clairvoyant.ratio,
        "clairvoyant_hit_tokens": (
            None if result.clairvoyant is None else result.clairvoyant.hit_tokens
        ),
        "stages": [
            {
                "stage_id": stage.stage_id,
                "restored_tokens": stage.restored_tokens,
                "computed_tokens": stage.computed_tokens,
                "token_hit_ratio": stage.token_hit_ratio,
                "hits": stage.hits,
                "records": stage.records,
                "evictions": stage.evictions,
                "evicted_bytes": stage.evicted_bytes,
                "resident_bytes_max": stage.resident_bytes_max,
                **_accounting_json(stage.accounting),
            }
            for stage in result.stages
        ],
        "ttft_s": ttft,
        "wall_s": result.wall_s,
        "tokens_per_s": result.tokens_per_s,
        "virtual_s": result.virtual_s,
        "arrival_span_s": result.arrival_span_s,
        "offered_load": None if load is None else attrs.asdict(load),
        "ttft_waiting_share": result.waiting_share,
        "config": config,
    }


def _accounting_json(accounting: CacheAccounting | None) -> dict[str, object]:
    """A stage's end-of-replay accounting keys (null values when the stage has no cache)."""
    if accounting is None:
        return dict.fromkeys(
            ("misses", "resident_bytes", "unique_prefix_bytes", "residency_ratio"), None
        )
    return {
        "misses": {
            "never_seen": accounting.misses_never_seen,
            "evicted": accounting.misses_evicted,
            "rejected": accounting.misses_rejected,
        },
        "resident_bytes": accounting.resident_bytes,
        "unique_prefix_bytes": accounting.unique_prefix_bytes,
        "residency_ratio": accounting.residency_ratio,
    }


def _table(
    console: Console,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    caption: str | None = None,
    left: int = 1,
) -> Table:
    """A report table whose cells are never cut short, on any console width.

    A column needs room for its widest cell and its header's longest word. When the headers do
    not fit on one line in the console, every column gets exactly that room and the headers
    wrap at their spaces; left to itself, rich would crop numbers instead ("5,663,..."). The
    first ``left`` columns are labels (left-justified), the rest are figures.
    """
    needed = [
        max([len(row[position]) for row in rows] + [len(word) for word in name.split()])
        for position, name in enumerate(headers)
    ]
    table = Table(
        title=title,
        caption=caption,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
        collapse_padding=True,
    )
    for position, name in enumerate(headers):
        justify: JustifyMethod = "left" if position < left else "right"
        table.add_column(name, justify=justify, min_width=needed[position])
    for row in rows:
        table.add_row(*row)
    # Two characters between columns (collapsed padding, no edges): the width on one line.
    one_line = sum(max(len(name), width) for name, width in zip(headers, needed, strict=True))
    if one_line + 2 * (len(headers) - 1) > console.width:
        for column, width in zip(table.columns, needed, strict=True):
            column.width = width
        narrowest = sum(needed) + 2 * (len(headers) - 1)
        if narrowest > console.width:
            # Too narrow even so: lay the table out wider than the console (print it with
            # crop=False) and let the terminal wrap its lines, rather than cut figures.
            table.width = narrowest
    return table


def _evictions(stages: Sequence[StageSummary]) -> str:
    counts = {stage.evictions for stage in stages}
    if len(counts) == 1:
        return f"{counts.pop():,}"
    return "/".join(f"{stage.evictions:,}" for stage in stages)


def _accounting_cells(stage: StageSummary) -> list[str]:
    """A stage's misses by reason and its resident vs unique-prefix bytes, as table cells."""
    acc = stage.accounting
    if acc is None:
        return ["-"] * 6
    return [
        f"{acc.misses_never_seen:,}",
        f"{acc.misses_evicted:,}",
        f"{acc.misses_rejected:,}",
        _bytes(acc.resident_bytes),
        _bytes(acc.unique_prefix_bytes),
        f"{acc.residency_ratio:.2f}x" if acc.unique_prefix_bytes else "-",
    ]


def _residency(stage: StageSummary) -> str:
    acc = stage.accounting
    return "-" if acc is None else f"{acc.residency_ratio:.2f}x"


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - the loop always returns


def _seconds(value: float) -> str:
    if value >= 1e6:  # absurd costs (--prefill-us-per-token 1e300) stay one short cell
        return f"{value:.3g} s"
    if value >= 1:
        return f"{value:,.2f} s"
    return f"{value * 1000:.1f} ms"


def _capacity(tokens: int) -> str:
    return "unbounded" if tokens == 0 else f"{tokens:,} tokens"


def _print_settings(console: Console, config: SimConfig, capacity: str) -> None:
    """The header lines: the pipeline, and each stage's cache bounds and index."""
    console.print(
        f"pipeline: {config.stages} stages, {config.bytes_per_token:,} activation bytes per "
        f"token, concurrency {config.concurrency}, blocks of {config.block_size} tokens"
    )
    if config.index is CacheIndex.PAGED:
        index = (
            f"paged: pages of {config.effective_page_tokens} "
            f"token{'s' if config.effective_page_tokens != 1 else ''}, {config.page_eviction} "
            f"eviction, min {config.min_prefix_tokens} tokens"
        )
    else:
        stride = f"stride {config.stride}"
        if config.effective_stride != config.stride:
            stride += f" (grid every {config.effective_stride}: capped at the min)"
        index = (
            f"ladder: min {config.min_prefix_tokens} tokens, {stride}, "
            f"record limit {config.record_limit}"
        )
    console.print(f"cache per stage: {config.max_entries:,} entries, {capacity}; {index}")


def render_report(
    console: Console, result: ReplayResult, *, title: str, skipped_lines: int = 0
) -> None:
    """Print one replay as tables: totals, stages, time to first token.

    Args:
        console: Where to print.
        result: The replay.
        title: What was replayed (shown on the first line).
        skipped_lines: Malformed trace lines skipped (shown when not 0).
    """
    console.print(Text(title, style="bold"))  # a path: no markup
    _print_settings(console, result.config, _capacity(result.capacity_tokens))

    totals = Table(box=box.SIMPLE, show_header=False)
    totals.add_column("what")
    totals.add_column("value", justify="right")
    totals.add_row("requests", f"{result.requests:,}")
    if skipped_lines:
        totals.add_row("skipped bad lines", f"{skipped_lines:,}")
    totals.add_row("prompt tokens", f"{result.prompt_tokens:,}")
    totals.add_row("restored tokens (stage 0)", f"{result.restored_tokens:,}")
    totals.add_row("token hit ratio", f"{result.token_hit_ratio:.1%}")
    totals.add_row("theoretical max (infinite cache, per block)", f"{result.theoretical.ratio:.1%}")
    totals.add_row("wall time", _seconds(result.wall_s))
    totals.add_row("replay speed", f"{result.tokens_per_s:,.0f} tokens/s")
    totals.add_row("simulated time (virtual clock)", _seconds(result.virtual_s))
    load = result.offered_load
    if load is not None:
        totals.add_row(
            "load: busiest stage's work / arrival span",
            f"{load.cached:,.2f} with cache, {load.uncached:,.2f} without",
        )
    waiting = result.waiting_share
    if waiting is not None:
        # Summed over requests: a few short prompts behind a long one can wait more than
        # they work while the median request does not wait at all.
        totals.add_row("share of all TTFT spent queueing", f"{waiting:.0%} (with cache)")
    console.print(totals)

    # Two narrow tables rather than one wide one: on an 80-column terminal a single table of
    # ten columns had rich cut numbers short ("183,...").
    stage_rows = [
        [
            stage.stage_id,
            f"{stage.restored_tokens:,}",
            f"{stage.computed_tokens:,}",
            f"{stage.token_hit_ratio:.1%}",
            f"{stage.records:,}",
            f"{stage.evictions:,}",
            _bytes(stage.resident_bytes_max),
        ]
        for stage in result.stages
    ]
    stage_headers = ["stage", "restored", "computed", "hit ratio", "records", "evictions"]
    stage_headers += ["peak resident"]
    console.print(_table(console, "per stage", stage_headers, stage_rows), crop=False)
    console.print()
    if any(stage.accounting is not None for stage in result.stages):
        cache_headers = ["stage", "hits", "misses: never seen", "evicted", "rejected"]
        cache_headers += ["resident", "unique", "ratio"]
        cache_rows = [
            [stage.stage_id, f"{stage.hits:,}", *_accounting_cells(stage)]
            for stage in result.stages
        ]
        console.print(
            _table(
                console,
                "lookups and bytes held at the end",
                cache_headers,
                cache_rows,
                caption="hits: requests that restored tokens; rejected: validation refused a "
                "cached entry; resident vs unique: bytes held vs bytes the distinct prefixes "
                "need",
            ),
            crop=False,
        )

    console.print()
    ttft_rows = []
    for name in ("p50", "p90", "p99"):
        cached = getattr(result.ttft_cached, name)
        uncached = getattr(result.ttft_uncached, name)
        saved = 1 - cached / uncached if uncached > 0 else 0.0
        saved = 0.0 if abs(saved) < 0.005 else saved  # no "-0%"
        # A cache slower than none (a costly restore) shows a negative saving; past -999% the
        # figure says nothing more and would only widen the table.
        shown = "< -999%" if saved < -9.99 else f"{saved:.0%}"
        ttft_rows.append([name, _seconds(cached), _seconds(uncached), shown])
    console.print(
        _table(
            console,
            "time to first token (simulated)",
            ["", "with cache", "without cache", "saved"],
            ttft_rows,
            left=0,
        ),
        crop=False,
    )
    queueing = _queueing_sentence(result)
    if queueing:
        console.print(queueing)
    gap = result.theoretical.ratio - result.token_hit_ratio
    if gap < 0.0005:  # less than what the percentages show (0.1%)
        hint = "Nothing more was there to restore."
    elif result.config.index is CacheIndex.LADDER:
        hint = (
            "Try --index paged (prompts share pages, so any shared prefix can be restored), "
            "--max-entries or --sweep-capacity to see what closes the gap."
        )
    else:  # (paged: every page is an entry, and --capacity-tokens bounds them)
        hint = "Try --capacity-tokens or --sweep-capacity to see what closes the gap."
    console.print(
        f"The cache restored {result.token_hit_ratio:.1%} of prompt tokens at stage 0; an "
        f"infinite cache could restore {result.theoretical.ratio:.1%}. {hint}"
    )
    split = _gap_split(result)
    if split:
        console.print(split)


def _gap_split(result: ReplayResult) -> str | None:
    """How much of the distance to the infinite cache is capacity and how much is policy."""
    ceiling = result.clairvoyant
    if ceiling is None or result.capacity_tokens == 0:
        return None
    capacity = result.theoretical.ratio - ceiling.ratio
    policy = ceiling.ratio - result.token_hit_ratio
    return (
        f"At this capacity a clairvoyant cache (Belady: evict the page used furthest in the "
        f"future) would restore {ceiling.ratio:.1%}: of the {result.theoretical.ratio:.1%} an "
        f"infinite cache restores, {capacity:.1%} is out of reach of any policy at this "
        f"capacity, and {policy:.1%} is what the eviction policy loses."
    )


_QUEUEING_WORTH_A_WORD = 0.5
"""Share of all time to first token spent queueing from which the report explains it."""


def _queueing_sentence(result: ReplayResult) -> str:
    """What the load says about the time to first token, when there is something to say.

    Otherwise a reader takes minutes of queueing for the cost of a prefill.
    """
    load, waiting = result.offered_load, result.waiting_share
    if load is None or waiting is None:
        return ""
    span = _seconds(result.arrival_span_s)
    if load.cached > 1:
        said = (
            f"With the cache the busiest stage has {load.cached:,.2f} times the work it can do "
            f"in the {span} the arrivals span ({load.uncached:,.2f} without): it cannot keep "
            "up, so requests queue"
        )
    elif load.uncached > 1:
        said = (
            f"Without the cache the busiest stage could not keep up with these arrivals (load "
            f"{load.uncached:,.2f}); with it, its load is {load.cached:,.2f} on average"
        )
    elif waiting >= _QUEUEING_WORTH_A_WORD:
        said = (
            f"The busiest stage keeps up on average (load {load.cached:,.2f} with the cache), "
            "but arrivals come in bursts and prompts differ in length"
        )
    else:
        return ""
    return (
        f"{said}: {waiting:.0%} of all time to first token (with the cache) is spent in queues. "
        "Lower --prefill-us-per-token or --restore-ns-per-byte model faster stages."
    )


def sweep_order(results: Sequence[ReplayResult]) -> list[ReplayResult]:
    """A sweep's results by increasing capacity, the unbounded one (capacity 0) last."""
    return sorted(results, key=lambda r: (r.capacity_tokens == 0, r.capacity_tokens))


def render_sweep(console: Console, results: Sequence[ReplayResult], *, title: str) -> None:
    """Print a capacity sweep as one table: a row per capacity, smallest first, unbounded last.

    The capacity bounds each stage's cache; the hit ratio and resident/unique columns are stage
    0's, evictions are listed stage by stage, and peak resident is the largest stage's. TTFT
    without the cache and the total wall time, the same for every row, follow the table.
    """
    console.print(Text(title, style="bold"))  # a path: no markup
    if not results:
        return
    first = results[0]
    _print_settings(console, first.config, "capacity swept (below)")
    console.print(
        f"{first.requests:,} requests, {first.prompt_tokens:,} prompt tokens, theoretical max "
        f"{first.theoretical.ratio:.1%} (infinite cache, per block)"
    )
    stage_ids = " / ".join(stage.stage_id for stage in first.stages)
    rows = [
        [
            "unbounded" if result.capacity_tokens == 0 else f"{result.capacity_tokens:,}",
            _bytes(result.config.max_bytes(result.capacity_tokens))
            if result.capacity_tokens
            else "unbounded",
            f"{result.token_hit_ratio:.1%}",
            _evictions(result.stages),
            _bytes(max(stage.resident_bytes_max for stage in result.stages)),
            _residency(result.stages[0]),
            _seconds(result.ttft_cached.p50),
            _seconds(result.ttft_cached.p99),
        ]
        for result in sweep_order(results)
    ]
    headers = [
        "capacity (tokens)",
        "max bytes",
        "hit ratio (stage 0)",
        "evictions per stage",
        "peak resident (largest stage)",
        "held / unique (stage 0)",
        "TTFT p50",
        "TTFT p99",
    ]
    console.print(
        _table(
            console,
            "capacity sweep (capacity and max bytes bound each stage's cache)",
            headers,
            rows,
            left=0,
            caption=f"evictions: one figure if every stage evicted as many, else {stage_ids}. "
            "held / unique: resident bytes over the bytes the distinct prefixes need. "
            + (
                "A page larger than max bytes is not stored."
                if first.config.index is CacheIndex.PAGED
                else "An entry larger than max bytes is kept alone, so peak resident can "
                "exceed max bytes."
            ),
        ),
        crop=False,
    )
    console.print(
        f"TTFT without cache: p50 {_seconds(first.ttft_uncached.p50)}, p99 "
        f"{_seconds(first.ttft_uncached.p99)}; wall time "
        f"{_seconds(sum(result.wall_s for result in results))} for {len(results)} "
        f"{'replay' if len(results) == 1 else 'replays'}"
    )
    ceilings = [
        f"{result.capacity_tokens:,}: {result.clairvoyant.ratio:.1%}"
        for result in sweep_order(results)
        if result.clairvoyant is not None and result.capacity_tokens > 0
    ]
    if ceilings:
        console.print(
            "clairvoyant ceiling (Belady: evict the page used furthest in the future) at each "
            f"capacity: {', '.join(ceilings)}; the gap to it is the eviction policy's, the rest "
            "of the gap to the theoretical max is capacity's"
        )


PLOT_FORMATS = ("png", "svg", "pdf")
"""Formats :func:`write_plot` writes, chosen by the path's suffix (no suffix: PNG)."""


def plot_format(path: str | os.PathLike[str]) -> str:
    """The format a plot at ``path`` is written in: its suffix's, or PNG without one.

    Raises:
        ConfigError: the suffix names another format.
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    if not suffix:
        return "png"
    if suffix not in PLOT_FORMATS:
        choices = ", ".join(f".{name}" for name in PLOT_FORMATS)
        msg = (
            f"cannot write a plot to {os.fspath(path)}: the suffix must be {choices} "
            f"(or none, for PNG), got .{suffix}"
        )
        raise ConfigError(msg)
    return suffix


def write_plot(results: Sequence[ReplayResult], path: str | os.PathLike[str]) -> None:
    """Write a plot: hit ratio against capacity for a sweep, else restored vs computed per request.

    Args:
        results: One replay, or a sweep (several).
        path: The file to write, exactly there: PNG, or SVG/PDF for those suffixes.

    Raises:
        ConfigError: matplotlib is not installed (``pip install 'stage-runtime[plot]'``), or the
            suffix names a format other than PNG, SVG or PDF.
    """
    file_format = plot_format(path)
    figure = plot_figure(results)
    figure.savefig(os.fspath(path), dpi=120, format=file_format)


def plot_figure(results: Sequence[ReplayResult]) -> Figure:
    """The figure :func:`write_plot` writes, for a caller that wants to show or adjust it.

    Raises:
        ConfigError: no results, or matplotlib is not installed (``pip install
            'stage-runtime[plot]'``).
    """
    if not results:
        msg = "results must hold at least one replay, got none"
        raise ConfigError(msg)
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator, PercentFormatter, StrMethodFormatter
    except ImportError as exc:
        msg = "--plot needs matplotlib; install it with: pip install 'stage-runtime[plot]'"
        raise ConfigError(msg) from exc

    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.add_subplot()
    if len(results) > 1:
        # Increasing capacity left to right; unbounded is not a capacity on that axis, so it
        # stands apart at the right with its own marker, not joined to the line.
        ordered = sweep_order(results)
        bounded = [r for r in ordered if r.capacity_tokens > 0]
        unbounded = [r for r in ordered if r.capacity_tokens == 0]
        labels = [f"{r.capacity_tokens:,}" for r in bounded] + ["unbounded"] * len(unbounded)
        positions = list(range(len(ordered)))
        if bounded:
            axes.plot(
                positions[: len(bounded)],
                [r.token_hit_ratio for r in bounded],
                marker="o",
                label="token hit ratio",
            )
            ceiling = [r for r in bounded if r.clairvoyant is not None]
            if len(ceiling) == len(bounded):
                axes.plot(
                    positions[: len(bounded)],
                    [r.clairvoyant.ratio for r in ceiling if r.clairvoyant is not None],
                    marker="^",
                    linestyle=":",
                    color="tab:purple",
                    label="clairvoyant (Belady) at that capacity",
                )
        if unbounded:
            axes.plot(
                positions[len(bounded) :],
                [r.token_hit_ratio for r in unbounded],
                marker="*",
                markersize=12,
                linestyle="none",
                color="tab:green",
                label="unbounded cache",
            )
        axes.axhline(
            results[0].theoretical.ratio,
            linestyle="--",
            color="grey",
            label="theoretical max (infinite cache)",
        )
        axes.set_xticks(positions, labels)
        axes.set_xlabel("cache capacity per stage (tokens)")
        axes.set_ylabel("token hit ratio (stage 0)")
        # Scaled to the figures, not to 100%: hit ratios of a few percent would otherwise lie
        # flat along the axis.
        top = max(results[0].theoretical.ratio, *(r.token_hit_ratio for r in ordered))
        axes.set_ylim(0, min(1.0, max(top * _HEADROOM, _LOWEST_TOP)))
        axes.yaxis.set_major_formatter(PercentFormatter(xmax=1))
        axes.set_title("Token hit ratio against cache capacity")
    else:
        result = results[0]
        indices = [outcome.index for outcome in result.outcomes]
        restored = [outcome.restored_tokens[0] for outcome in result.outcomes]
        computed = [o.input_length - o.restored_tokens[0] for o in result.outcomes]
        # An outline of the bar's own colour, about a pixel wide: with more requests than the
        # axes has pixels, a bar is narrower than a pixel and its fill alone may not be drawn
        # at all (the tallest of 1,000 requests went missing at 960x540). Empty bars get none:
        # it would draw a line where there is nothing.
        axes.bar(
            indices,
            computed,
            width=1.0,
            label="computed",
            color="tab:orange",
            edgecolor="tab:orange",
            linewidth=[_OUTLINE_PT if tokens else 0.0 for tokens in computed],
        )
        axes.bar(
            indices,
            restored,
            width=1.0,
            bottom=computed,
            label="restored",
            color="tab:blue",
            edgecolor="tab:blue",
            linewidth=[_OUTLINE_PT if tokens else 0.0 for tokens in restored],
        )
        axes.set_xlabel("request")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # (no request 2.5)
        axes.set_ylabel("prompt tokens (stage 0)")
        # Whole tokens, written as the report writes them (175,000).
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        axes.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
        axes.set_title(
            f"Restored vs computed tokens per request ({result.token_hit_ratio:.1%} restored)"
        )
    # Below the axes, so it never covers a point or a line (ratios near 100% included).
    figure.legend(loc="outside lower center", ncols=3)
    return figure


_OUTLINE_PT = 0.75
"""Outline of each per-request bar, in points: one pixel at 96 dpi, more at write_plot's 120."""

_HEADROOM = 1.25
"""The sweep plot's y axis reaches this much above its highest ratio (at most to 100%)."""
_LOWEST_TOP = 0.05
"""...and at least to 5%, so a sweep that restored nothing still has a readable axis."""
