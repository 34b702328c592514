"""Where the library's records go when a worker starts: once, with a timestamp and level.

Each case runs in a fresh interpreter, as a process starts: pytest's own handlers on the
root logger would otherwise count as configured logging.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

FRAMEWORK = """
import logging, sys
fs = logging.getLogger("faststream")  # as FastStream configures its own logger
fs.propagate = False
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)8s - %(message)s"))
fs.addHandler(handler)
fs.setLevel(logging.INFO)
from inbox_middleware._core import logs
"""
LOG = "logging.getLogger('inbox_middleware.faststream').info('inbox consumer billing protects')"

CASES = {
    "nothing configured: through FastStream's handler": (
        "logs.follow('faststream')\n" + LOG,
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}     INFO - inbox consumer billing protects$",
    ),
    "configured before start-up: only there": (
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='ROOT %(message)s')\n"
        "logs.follow('faststream')\n" + LOG,
        r"^ROOT inbox consumer billing protects$",
    ),
    "configured after start-up: only there": (
        "logs.follow('faststream')\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='ROOT %(message)s')\n"
        + LOG,
        r"^ROOT inbox consumer billing protects$",
    ),
    "a handler on the library's logger after start-up: only there": (
        "logs.follow('faststream')\n"
        "own = logging.StreamHandler(sys.stdout)\n"
        "own.setFormatter(logging.Formatter('OWN %(message)s'))\n"
        "logging.getLogger('inbox_middleware').addHandler(own)\n" + LOG,
        r"^OWN inbox consumer billing protects$",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logs__one_line_with_timestamp_and_level_wherever_logging_goes(case):
    code, expected = CASES[case]
    ran = subprocess.run(
        [sys.executable, "-c", FRAMEWORK + code], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr == ""
    lines = ran.stdout.splitlines()
    assert len(lines) == 1, ran.stdout
    assert re.match(expected, lines[0]), lines[0]


def test_logs__without_a_framework_handler_stderr_gets_timestamp_level_and_name():
    code = "from inbox_middleware._core import logs\nlogs.follow(None)\n" + LOG
    ran = subprocess.run(
        [sys.executable, "-c", "import logging\n" + code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0
    assert ran.stdout == ""
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}     INFO - inbox_middleware.faststream: "
        r"inbox consumer billing protects\n",
        ran.stderr,
    ), ran.stderr
