"""``python -m stage_runtime``: the same command line as ``stage-runtime``."""

from __future__ import annotations

import sys

from stage_runtime.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
