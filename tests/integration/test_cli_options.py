"""Every number and duration the command line takes is checked by click: a bad one is a
usage error naming the option (exit 2), never a database error, an OverflowError, or a
dispatcher told to sleep forever."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._storage import Inbox
from inbox_middleware.cli import main

from .test_cli import run

URL = ["--database-url", "postgresql://postgres@127.0.0.1:5432/test"]
DESTINATIONS = ["--destinations", "no_such_module:destinations"]


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["poison", "list", "--limit", "-1", *URL], "--limit"),
        (["quarantine", "list", "--limit", "0", *URL], "--limit"),
        (["outbox", "list", "--limit", "0", *URL], "--limit"),
        (["poison", "list", "--limit", "99999999999999999999", *URL], "--limit"),
        (["purge", "--older-than", "30d", "--batch-size", "9" * 20, *URL], "--batch-size"),
        (["outbox", "run", *DESTINATIONS, "--batch-size", "9" * 20, *URL], "--batch-size"),
        (["outbox", "run", *DESTINATIONS, "--max-attempts", "0", *URL], "--max-attempts"),
        (["outbox", "run", *DESTINATIONS, "--max-attempts", "9" * 20, *URL], "--max-attempts"),
        (["poison", "list", "--since", "99999999999d", *URL], "--since"),
        (["quarantine", "list", "--until", "yesterday", *URL], "--until"),
        (["poison", "show", "99999999999999999999", *URL], "ROW_ID"),
        (["poison", "discard", "0", "--reason", "x", *URL], "ROW_IDS"),
        (["purge", "--older-than", "99999999999d", *URL], "--older-than"),
        (["purge", "--older-than", "36501d", *URL], "--older-than"),
        (["purge", "--older-than", "soon", *URL], "--older-than"),
        (["purge", "--older-than", "30d", "--pause", "inf", *URL], "--pause"),
        (["purge", "--older-than", "30d", "--pause", "-1", *URL], "--pause"),
        (["retention", "calculate", "--retry-horizon", "999999999999w"], "--retry-horizon"),
        (["retention", "calculate", "--margin", "nan"], "--margin"),
        (["retention", "set", "--broker-retention", "1e9d", *URL], "--broker-retention"),
        (["status", "--window", "99999999999d", *URL], "--window"),
        (["outbox", "run", *DESTINATIONS, "--poll-interval", "inf", *URL], "--poll-interval"),
        (["outbox", "run", *DESTINATIONS, "--poll-interval", "0", *URL], "--poll-interval"),
        (["outbox", "run", *DESTINATIONS, "--backoff-cap", "inf", *URL], "--backoff-cap"),
        (["outbox", "run", *DESTINATIONS, "--backoff-base", "nan", *URL], "--backoff-base"),
        (["outbox", "run", *DESTINATIONS, "--lease", "-inf", *URL], "--lease"),
        (["outbox", "run", *DESTINATIONS, "--delivery-timeout", "nan", *URL], "--delivery-timeout"),
        (["outbox", "run", *DESTINATIONS, "--shutdown-grace", "inf", *URL], "--shutdown-grace"),
        (["metrics", "serve", "--port", "70000", "--multiprocess-dir", "."], "--port"),
        (
            ["metrics", "serve", "--cache-seconds", "inf", "--multiprocess-dir", "."],
            "--cache-seconds",
        ),
    ],
)
def test_cli__a_bad_number_or_duration_is_a_usage_error_naming_its_option(args, option):
    result = CliRunner().invoke(main, args)

    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: Invalid value for '"), lines[0]
    assert option in lines[0].split(":")[1], lines[0]


def test_cli__the_console_script_says_which_option_is_wrong_in_one_line():
    # The errors the issue saw, as a user sees them: one line each, exit status 2
    for args, option in [
        (["poison", "list", "--limit", "-1", *URL], "--limit"),
        (["purge", "--older-than", "99999999999d", *URL], "--older-than"),
        (["outbox", "run", *DESTINATIONS, "--backoff-cap", "inf", *URL], "--backoff-cap"),
    ]:
        result = run(*args)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"error: Invalid value for '{option}'"), result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr


def test_cli__a_long_but_sane_window_is_taken(pg_url):
    # 100 years is the longest window; the purge finds nothing that old, and says so
    result = CliRunner().invoke(
        main, ["purge", "--older-than", "36500d", "--force", "--dry-run", "--database-url", pg_url]
    )
    assert result.exit_code == 0, result.output
    assert "would delete 0 claims processed more than 5214w2d ago (--dry-run)" in result.output


def test_quarantine__accept_dry_run_needs_no_broker_url(pg_url, pg_engine):
    # Given a quarantined conflict
    inbox = Inbox(pg_engine)
    identity = MessageIdentity("orders", "o-dry")
    inbox.process(Delivery("billing", identity, hash_json({"amount": 10}, "json.v1")), lambda s: 1)
    inbox.process(Delivery("billing", identity, hash_json({"amount": 25}, "json.v1")), lambda s: 1)
    runner = CliRunner(env={"INBOX_BROKER_URL": None})
    for action in ("accept", "redrive"):
        # When the operator asks what accept (or redrive) would do, with no broker at hand
        dry = runner.invoke(
            main,
            ["quarantine", action, "--consumer", "billing", "--dry-run", "--database-url", pg_url],
        )
        # Then the dry run lists the row, and publishes nothing
        assert dry.exit_code == 0, dry.output
        assert f"would {action} 1 quarantine rows (--dry-run)" in dry.output
        # And the real run still demands the broker
        real = runner.invoke(
            main, ["quarantine", action, "--consumer", "billing", "--database-url", pg_url]
        )
        assert real.exit_code == 2, real.output
        assert "Missing option '--broker-url'" in real.output
    listed = runner.invoke(main, ["quarantine", "list", "--database-url", pg_url])
    assert "o-dry" in listed.output and "pending" in listed.output
