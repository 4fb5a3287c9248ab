"""The hot path's unchecked constructors build what the classes' own ``__init__`` builds."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from stage_runtime._unchecked import unchecked_constructor
from stage_runtime.cache.ladder import _resident_record
from stage_runtime.cache.resident import EvictedEntry, _evicted_entry
from stage_runtime.cache.results import ResidentActivationRecord


def test_an_unchecked_eviction_equals_a_checked_one() -> None:
    fields: tuple[Any, ...] = ("act:s:0:512:0:ab:w8", 512, 4096, "max_bytes", 3, 12_288)
    names = [field.name for field in attrs.fields(EvictedEntry)]
    checked = EvictedEntry(**dict(zip(names, fields, strict=True)))
    unchecked = _evicted_entry(*fields)
    assert type(unchecked) is EvictedEntry
    assert unchecked == checked
    assert hash(unchecked) == hash(checked)
    assert attrs.asdict(unchecked) == attrs.asdict(checked)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        unchecked.key = "other"  # type: ignore[misc]


def test_an_unchecked_record_equals_a_checked_one() -> None:
    evicted = (_evicted_entry("act:x", 512, 4096, "max_entries", 63, 0),)
    fields: tuple[Any, ...] = ("act:s:0:1024:0:cd:w8", 1024, 8192, 1, 4096, 64, 524_288, evicted)
    names = [field.name for field in attrs.fields(ResidentActivationRecord)]
    assert len(names) == len(fields)  # a new field must be passed by the ladder index too
    checked = ResidentActivationRecord(**dict(zip(names, fields, strict=True)))
    unchecked = _resident_record(*fields)
    assert unchecked == checked
    assert repr(unchecked) == repr(checked)


def test_only_slotted_attrs_classes_have_one() -> None:
    @attrs.frozen(slots=False)
    class Loose:
        value: int

    with pytest.raises(TypeError, match="slotted"):
        unchecked_constructor(Loose)
    with pytest.raises(attrs.exceptions.NotAnAttrsClassError):
        unchecked_constructor(int)


def test_a_stages_unchecked_messages_hold_what_checked_ones_would() -> None:
    """For the read-only tokens a stage gets from the pipeline, the messages it builds unchecked
    hold the same fields as checked ones, the tokens themselves included (not a copy)."""
    import numpy as np

    from stage_runtime.cache_actor import RecordActivation, RestoreActivationPages
    from stage_runtime.config import MessageBase
    from stage_runtime.frames import ActivationFrame
    from stage_runtime.stage import _unchecked_record, _unchecked_restore

    tokens = np.arange(16, dtype=np.int32)
    tokens.flags.writeable = False
    base = MessageBase(stage_id="stage-0")
    frame = ActivationFrame.virtual(token_count=16, bytes_per_token=8, fill=1)
    restore = _unchecked_restore(base, tokens, 2, 0)
    record = _unchecked_record(base, tokens, 2, frame, 0)
    checked_restore = RestoreActivationPages(base=base, tokens=tokens, activation_width=2)
    checked_record = RecordActivation(base=base, tokens=tokens, activation_width=2, frame=frame)
    assert attrs.asdict(restore, recurse=False) == attrs.asdict(checked_restore, recurse=False)
    assert attrs.asdict(record, recurse=False) == attrs.asdict(checked_record, recurse=False)
    assert restore.tokens is tokens
    assert checked_restore.tokens is tokens


def test_a_stages_unchecked_report_equals_a_checked_one() -> None:
    from stage_runtime.stage import StagePrefillReport, _unchecked_report

    record = _resident_record("act:s:0:512:0:ab:w8", 512, 4096, 1, 4096, 1, 4096, ())
    fields: tuple[Any, ...] = ("stage-1", 1, 512, 88, (record,), (), 2.5, 3.25)
    names = [field.name for field in attrs.fields(StagePrefillReport)]
    assert len(names) == len(fields)  # a new field must be passed by the stage too
    checked = StagePrefillReport(**dict(zip(names, fields, strict=True)))
    unchecked = _unchecked_report(*fields)
    assert type(unchecked) is StagePrefillReport
    assert unchecked == checked
    assert repr(unchecked) == repr(checked)


def test_an_unchecked_frame_holds_what_a_checked_one_would() -> None:
    """A prefix and a virtual frame's rows, built unchecked, have the descriptor and the
    payload a checked frame of theirs has (frames compare by identity: field by field)."""
    import numpy as np

    from stage_runtime.frames import ActivationFrame, _unchecked_frame

    rows = np.arange(24, dtype=np.float32).reshape(6, 4)
    real = ActivationFrame.from_array(rows, producer_stage_index=2, layer_start=3, layer_end=5)
    virtual = ActivationFrame.virtual(token_count=1, bytes_per_token=8, fill=7)
    for unchecked in (real._cut(4), virtual._virtual_rows(5, fill=7)):
        checked = ActivationFrame(desc=unchecked.desc, payload=unchecked.payload)
        assert type(unchecked) is ActivationFrame
        assert unchecked.same_content(checked)
        assert repr(unchecked) == repr(checked)
        assert unchecked.payload is checked.payload  # (read-only already: not re-viewed)
    assert real._cut(4).same_content(real.prefix(4))
    assert virtual._virtual_rows(5, fill=7).same_content(
        ActivationFrame.virtual(token_count=5, bytes_per_token=8, fill=7)
    )
    frame = _unchecked_frame(real.desc, real.payload)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        frame.desc = virtual.desc  # type: ignore[misc]


def test_a_pipelines_unchecked_result_equals_a_checked_one() -> None:
    import numpy as np

    from stage_runtime.frames import ActivationFrame
    from stage_runtime.pipeline import PrefillResult, _unchecked_result
    from stage_runtime.stage import StagePrefillReport

    frame = ActivationFrame.virtual(token_count=16, bytes_per_token=8)
    report = StagePrefillReport(
        stage_id="stage-0",
        stage_index=0,
        restored_tokens=0,
        computed_tokens=16,
        records=(),
        evicted=(),
    )
    logits = np.zeros(4, dtype=np.float32)
    fields: tuple[Any, ...] = ("request-1", frame, 16, (report,), logits)
    names = [field.name for field in attrs.fields(PrefillResult)]
    assert len(names) == len(fields)  # a new field must be passed by the pipeline too
    checked = PrefillResult(**dict(zip(names, fields, strict=True)))
    unchecked = _unchecked_result(*fields)
    assert type(unchecked) is PrefillResult
    assert attrs.asdict(unchecked, recurse=False) == attrs.asdict(checked, recurse=False)
    assert repr(unchecked) == repr(checked)


def test_a_stages_trusted_messages_cannot_be_made_by_hand() -> None:
    """The actor takes a stage's own messages as they are: their constructors refuse, so only
    the stage's unchecked builders make them (from values it checked)."""
    import numpy as np

    from stage_runtime.cache_actor import _StageRecord, _StageRestore
    from stage_runtime.config import MessageBase

    base = MessageBase(stage_id="stage-0")
    tokens = np.arange(4, dtype=np.int32)
    for kind in (_StageRestore, _StageRecord):
        with pytest.raises(TypeError, match="only a stage builds this message"):
            kind(base=base, tokens=tokens, activation_width=2)
