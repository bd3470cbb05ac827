"""The first-slice report: our server alone on the default model, over HTTP.

    .venv/bin/python -m bench.first_slice [--quick]

Single-stream decode tokens/s, aggregate tokens/s at 1, 4 and 16 concurrent streams, the server's RSS and
start-up time; appended to bench/RESULTS.md. (Same as ``python -m bench.harness --first-slice``.)
"""

from __future__ import annotations

import sys

from bench.harness import main

if __name__ == "__main__":
    sys.exit(main(["--first-slice", "--no-inproc", *sys.argv[1:]]))
