"""A purge of every consumer judges each one under its own recorded retention policy:
a consumer that recorded a longer window keeps its claims, and is named with the reason."""

from __future__ import annotations

import uuid

from click.testing import CliRunner
from sqlalchemy import text

from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._storage import Inbox
from inbox_middleware.cli import main

from .test_cli import run


def claim(inbox: Inbox, consumer: str, message_id: str) -> Decision:
    delivery = Delivery(consumer, MessageIdentity("orders", message_id), hash_json(1, "json.v1"))
    return inbox.process(delivery, lambda session: None).verdict.decision


def claims(engine, consumer: str) -> int:
    with engine.connect() as conn:
        return conn.scalar(
            text("SELECT count(*) FROM consumer_inbox WHERE consumer_name = :c"), {"c": consumer}
        )


def test_purge__every_consumer_is_judged_under_its_own_recorded_window(pg_url, pg_engine):
    suffix = uuid.uuid4().hex[:6]
    billing, shipping = f"billing-{suffix}", f"shipping-{suffix}"
    inbox = Inbox(pg_engine)
    for consumer in (billing, shipping):
        for n in range(3):
            assert claim(inbox, consumer, f"m-{n}") is Decision.FIRST
    with pg_engine.begin() as conn:
        conn.execute(text("UPDATE consumer_inbox SET processed_at = now() - interval '1 day'"))
    # Given billing's dead letters kept two weeks, and a default policy of nothing at all
    url = ["--database-url", pg_url]
    runner = CliRunner()
    own = ["retention", "set", "--consumer", billing, "--dead-letter-retention", "14d"]
    assert runner.invoke(main, [*own, *url]).exit_code == 0
    assert runner.invoke(main, ["retention", "set", *url]).exit_code == 0
    # And a purge of billing alone is refused, as it always was
    alone = run("purge", "--consumer", billing, "--older-than", "1s", *url)
    assert alone.returncode == 1
    assert alone.stderr.startswith("error: purging claims younger than 2w3d12h is refused")

    # When the operator purges every consumer: first a dry run, then for real
    dry = run("purge", "--older-than", "1s", "--dry-run", *url)
    done = run("purge", "--older-than", "1s", *url)

    # Then shipping's claims go (the default allows it), billing's stay, and both runs
    # name billing with the reason and exit with 1
    for result in (dry, done):
        assert result.returncode == 1, result.stderr
        assert result.stderr.splitlines() == [
            f"error: consumer {billing} kept: purging claims younger than 2w3d12h is refused: "
            "its recorded policy needs that long for its dominant scenario (dead-letter "
            "redrive); a copy delivered later would be processed again. To apply old "
            "messages once more, see the replay guide (a versioned consumer or a "
            "compensating migration), never the purge"
        ]
    assert dry.stdout == "would delete 3 claims processed more than 1s ago (--dry-run)\n"
    assert done.stdout.startswith("deleted 3 claims processed more than 1s ago in ")
    assert (claims(pg_engine, billing), claims(pg_engine, shipping)) == (3, 0)
    # And a later copy of billing's message is still a duplicate, never applied twice
    assert claim(inbox, billing, "m-0") is Decision.DUPLICATE


def test_purge__a_consumer_without_any_policy_that_applies_is_refused(pg_url, pg_engine):
    suffix = uuid.uuid4().hex[:6]
    billing, shipping = f"billing-{suffix}", f"shipping-{suffix}"
    inbox = Inbox(pg_engine)
    claim(inbox, billing, "m-1")
    claim(inbox, shipping, "m-1")
    with pg_engine.begin() as conn:
        conn.execute(text("UPDATE consumer_inbox SET processed_at = now() - interval '30 days'"))
    url = ["--database-url", pg_url]
    # Given a policy recorded for billing only (no default)
    set_ = CliRunner().invoke(main, ["retention", "set", "--consumer", billing, *url])
    assert set_.exit_code == 0, set_.output

    done = run("purge", "--older-than", "7d", *url)

    # Then billing's old claim goes, shipping's stays: nothing says how long it must live
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"error: consumer {shipping} kept: no retention policy is recorded: record the "
        "failure scenarios first (inbox-middleware retention set ...), or pass --force"
    ]
    assert (claims(pg_engine, billing), claims(pg_engine, shipping)) == (0, 1)
    # And --force purges it, saying so
    forced = run("purge", "--older-than", "7d", "--force", *url)
    assert forced.returncode == 0, forced.stderr
    assert forced.stderr == "warning: no retention policy is recorded; purging anyway (--force)\n"
    assert claims(pg_engine, shipping) == 0
