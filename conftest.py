"""The documentation's code blocks run as tests (Sybil): the README's and every page of docs/.

Each page is one namespace, its blocks run in order from the repository root (as a reader runs
them). A ``python`` block runs as written; a block of ``>>>`` lines is a doctest whose output is
checked; a ``toml`` block must parse, and its text is left in the namespace as ``last_toml`` for
an invisible block to check further. ``% skip: next "reason"`` skips a block that needs what a
test run does not have (a Ray cluster, a server running until interrupted).
"""

from __future__ import annotations

import doctest
import logging
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import structlog
from sybil import Example, Sybil
from sybil.parsers.myst import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent


def _check_toml(example: Example) -> None:
    tomllib.loads(example.parsed)
    example.namespace["last_toml"] = example.parsed


def _setup(namespace: dict[str, Any]) -> None:
    namespace["_saved"] = (os.getcwd(), dict(structlog.get_config()))
    os.chdir(ROOT)
    # What the tutorial's first block configures: the library's events, warnings and up, on
    # stderr, so that a doctest's expected output is the program's own.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _teardown(namespace: dict[str, Any]) -> None:
    cwd, config = namespace["_saved"]
    os.chdir(cwd)
    structlog.reset_defaults()
    structlog.configure(**config)


pytest_collect_file = Sybil(
    parsers=[
        PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE),
        CodeBlockParser(language="toml", evaluator=_check_toml),
        SkipParser(),
    ],
    patterns=["README.md", "docs/*.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()
