"""The documentation's rules, and the snippets of its smaller guides, run.

Rules: every Python block in the docs is an include of a file the tests run (never code
typed into the page), every include names a file and section that exist, every page is
in the navigation, and the README's links lead to pages that exist.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import yaml
from sqlalchemy import Engine, create_engine, inspect, select, text

from inbox_middleware._storage import InboxSchema, migrate
from inbox_middleware._storage.layout import switch_claims
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

from ..apps.domain import balance
from ..support.dramatiq_worker import drain, running_worker
from ..support.snippets import load_snippet as load

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
PAGES = sorted(path for path in DOCS.rglob("*.md") if SNIPPETS not in path.parents)
PYTHON = {"python", "py", "python3", "pycon", "{.python"}
INCLUDE = re.compile(r'--8<-- "(?P<path>[^":]+)(?::(?P<section>[a-z][-_0-9a-z]*))?"')
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> Iterator[Block]:
    """The fenced code blocks of a Markdown page (indented ones in lists included)."""
    lines = page.read_text().splitlines()
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        number += 1
        if opening is None:
            continue
        fence, info = opening["fence"], opening["info"].strip()
        start, body = number, []
        while number < len(lines) and lines[number].strip() != fence:
            body.append(lines[number].strip())
            number += 1
        number += 1
        language = info.split()[0].lower() if info else ""
        yield Block(page, start, language, tuple(body))


def python_blocks() -> list[Block]:
    return [b for page in PAGES for b in code_blocks(page) if b.language in PYTHON]


# -- the rules ----------------------------------------------------------------------------


def test_docs__every_python_block_is_an_include_of_tested_code():
    # Given every ```python block of every page
    blocks = python_blocks()
    assert len(blocks) > 20, "the block scanner found too few Python blocks"
    # Then each holds include lines only: code typed into a page is run by nothing
    typed = [
        f"{block}: {line!r}"
        for block in blocks
        for line in block.lines
        if line and not INCLUDE.fullmatch(line)
    ]
    assert not typed, (
        "Python code written into the docs; move it into docs/snippets/ (or an examples/ "
        "section) that a test runs, and include it with --8<--:\n  " + "\n  ".join(typed)
    )


def includes() -> list[tuple[Block, re.Match[str]]]:
    found = []
    for page in PAGES:
        for block in code_blocks(page):
            for line in block.lines:
                if match := INCLUDE.fullmatch(line):
                    found.append((block, match))
    return found


def test_docs__every_include_names_a_file_and_section_that_exist():
    missing = []
    for block, match in includes():
        path = ROOT / match["path"]
        if not path.is_file():
            missing.append(f"{block}: no file {match['path']}")
            continue
        if block.language in PYTHON and not match["path"].startswith(
            ("examples/", "docs/snippets/")
        ):
            missing.append(f"{block}: Python is included from examples/ or docs/snippets/ only")
        if section := match["section"]:
            source = path.read_text()
            for marker in (f"[start:{section}]", f"[end:{section}]"):
                if f"--8<-- {marker}" not in source:
                    missing.append(f"{block}: {match['path']} has no {marker}")
    assert not missing, "\n".join(missing)


def test_docs__every_page_is_in_the_navigation():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_IgnoreTags)

    def pages(entry: Any) -> Iterator[str]:
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, list):
            for item in entry:
                yield from pages(item)
        elif isinstance(entry, dict):
            for value in entry.values():
                yield from pages(value)

    in_nav = set(pages(config["nav"]))
    written = {str(page.relative_to(DOCS)) for page in PAGES}
    assert written - in_nav == set(), "pages missing from mkdocs.yml's nav"
    assert in_nav - written == set(), "nav entries without a page"


class _IgnoreTags(yaml.SafeLoader):
    """mkdocs.yml uses !!python/name tags; the navigation does not need them resolved."""


_IgnoreTags.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)


def site_url() -> str:
    return str(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_IgnoreTags)["site_url"])


@pytest.mark.parametrize("readme", ["README.md", "README-pypi.md"])
def test_readme__links_to_pages_of_the_built_site_that_exist(readme: str):
    # The Markdown sources pull their code in at build time (`--8<--`), which GitHub shows
    # as it is: a reader is sent to the site, and each link to a page the site builds.
    text = (ROOT / readme).read_text()
    site = site_url()
    links = re.findall(r"\]\(" + re.escape(site) + r"([^)#]*)(?:#[^)]*)?\)", text)
    assert len(links) >= 10, "the README should send readers to the documentation"
    pages = {str(page.relative_to(DOCS).with_suffix("")) for page in PAGES}
    built = {("" if page == "index" else f"{page}/") for page in pages}
    assert [link for link in links if link not in built] == []
    sources = re.findall(r"\]\(([^)]*docs/[^)]*\.md)[^)]*\)", text)
    assert sources == [], "links to Markdown sources, which show include lines on GitHub"


def test_migrations_guide__counts_the_tables_migrate_creates(tmp_path: Path):
    engine = create_engine(f"sqlite:///{tmp_path / 'inbox.db'}")
    try:
        migrate(engine)
        tables = inspect(engine).get_table_names()
    finally:
        engine.dispose()
    words = [
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
    ]
    count = words[len(tables) - 1]
    guide = (DOCS / "how-to" / "migrations.md").read_text()
    assert f"dropping all {count}:" in guide, tables
    assert f"drops the {count} tables" in guide, tables


def test_docs__every_pip_install_of_the_project_is_quoted_and_names_its_extras():
    # Unquoted brackets are a file pattern to zsh ("no matches found"); and until the
    # package is on an index, only the installation page and the READMEs may show the
    # index's form, next to the clone's.
    declared = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    index_form_allowed = {"README.md", "README-pypi.md", "docs/install.md"}
    bad = []
    for page in [ROOT / "README.md", ROOT / "README-pypi.md", *PAGES]:
        name = str(page.relative_to(ROOT))
        for target in re.findall(
            r"pip install (?:-c \S+ )?([\w'./-]*\[[^\]]*\]'?)", page.read_text()
        ):
            quoted = re.fullmatch(r"'(?P<path>[^'\[]*)\[(?P<extras>[^\]]+)\]'", target)
            if quoted is None:
                bad.append((name, target, "not quoted"))
                continue
            unknown = set(quoted["extras"].split(",")) - declared
            if unknown:
                bad.append((name, target, f"no such extra: {sorted(unknown)}"))
            if quoted["path"] == "inbox-middleware" and name not in index_form_allowed:
                bad.append((name, target, "from an index, where the package is not yet"))
    assert bad == []


def test_readme__its_code_is_taken_from_a_tested_snippet():
    # The README cannot include files; each of its code lines must be one of the snippet's.
    readme = ROOT / "README.md"
    snippet = {line.strip() for line in (SNIPPETS / "add_to_dramatiq.py").read_text().splitlines()}
    blocks = [block for block in code_blocks(readme) if block.language in PYTHON]
    assert blocks, "the README shows how the middleware is added"
    lines = [line for block in blocks for line in block.lines if line]
    assert [line for line in lines if line not in snippet] == []


# -- the smaller guides' snippets ---------------------------------------------------------


def test_send_identities_snippet__copies_with_another_trace_id_are_duplicates(
    stub_broker: dramatiq.Broker, pg_engine: Engine
):
    # Given the guide's actor, whose payload hash leaves out the per-send trace id
    stub_broker.add_middleware(InboxMiddleware(pg_engine))
    snippet = load("send_identities")
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))
    created = datetime(2026, 11, 1, 9, 30, tzinfo=UTC)
    order = snippet.Order("o-1", "shop-3", account_id=7, amount=10, created_at=created)
    # When the order is sent three times with three trace ids, then reused for 11
    with running_worker(stub_broker, threads=1) as worker:
        for trace in ("t-1", "t-2", "t-3"):
            snippet.send_credit(order, trace_id=trace)
        snippet.send_credit(snippet.Order("o-1", "shop-3", 7, 11, created), trace_id="t-4")
        drain(stub_broker, "default", worker)
    # Then it is credited once, under the shop's tenant, and the reuse is a conflict
    tables = InboxSchema().tables
    with pg_engine.connect() as conn:
        claim = conn.execute(select(tables.inbox)).one()
        conflicts = conn.scalar(select(tables.quarantine.c.attempts))
        assert balance(conn, 7) == 10
    assert (claim.producer_name, claim.tenant, claim.message_id) == ("orders", "shop-3", "o-1")
    assert claim.hash_scheme == "custom.v2:credit-without-trace.v1"
    assert claim.produced_at == created
    assert conflicts == 1


def test_stamp_identities_snippet__a_plain_send_twice_is_credited_once(
    stub_broker: dramatiq.Broker, pg_engine: Engine
):
    # Given the guide's actor, whose first argument is the intent id
    stub_broker.add_middleware(InboxMiddleware(pg_engine))
    snippet = load("stamp_identities")
    snippet.stamp_refunds(stub_broker)
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))
    # When the order is sent twice with plain send() calls
    with running_worker(stub_broker, threads=1) as worker:
        snippet.credit_order("o-1", 7, 10)
        snippet.credit_order("o-1", 7, 10)
        drain(stub_broker, "default", worker)
    # Then it is credited once, under the producer's id
    with pg_engine.connect() as conn:
        claim = conn.execute(select(InboxSchema().tables.inbox)).one()
        assert balance(conn, 7) == 10
    assert (claim.producer_name, claim.message_id) == ("orders", "o-1")


def test_table_naming_snippet__the_claims_land_in_the_named_schema(
    stub_broker: dramatiq.Broker, pg_engine: Engine
):
    snippet = load("table_naming")
    try:
        # Given the tables created under the guide's naming, and the middleware given it
        migrate(pg_engine, snippet.NAMING)
        snippet.add_inbox(stub_broker, pg_engine)

        @dramatiq.actor(inbox_consumer="billing")
        def touch(n: int) -> None:
            current_session().execute(text("SELECT :n"), {"n": n})

        # When a message is processed
        with running_worker(stub_broker, threads=1) as worker:
            touch.send_with_options(args=(1,), **identity(producer="p", message_id="m-1"))
            drain(stub_broker, "default", worker)
        # Then its claim is in inbox.billing_consumer_inbox
        with pg_engine.connect() as conn:
            claims = conn.scalar(text('SELECT count(*) FROM "inbox"."billing_consumer_inbox"'))
            default = conn.scalar(text("SELECT count(*) FROM consumer_inbox"))
        assert (claims, default) == (1, 0)
    finally:
        with pg_engine.begin() as conn:
            conn.exec_driver_sql('DROP SCHEMA IF EXISTS "inbox" CASCADE')


def test_compact_claims_snippet__claims_land_in_the_compact_row_once_switched(
    stub_broker: dramatiq.Broker, pg_engine: Engine
):
    snippet = load("compact_claims")
    # Given the switch recorded (a new deployment), and the middleware the guide shows
    with pg_engine.begin() as conn:
        switch_claims(conn, InboxSchema(), by="docs")
    snippet.add_inbox(stub_broker, pg_engine)

    @dramatiq.actor(inbox_consumer="billing")
    def touch(n: int) -> None:
        current_session().execute(text("SELECT :n"), {"n": n})

    # When a message is processed twice
    with running_worker(stub_broker, threads=1) as worker:
        for _ in range(2):
            touch.send_with_options(args=(1,), **identity(producer="p", message_id="m-1"))
        drain(stub_broker, "default", worker)
    # Then its one claim is in inbox_claims, none in consumer_inbox
    with pg_engine.connect() as conn:
        compact = conn.scalar(text("SELECT count(*) FROM inbox_claims"))
        library = conn.scalar(text("SELECT count(*) FROM consumer_inbox"))
    assert (compact, library) == (1, 0)


def test_permanent_failure_snippet__unknown_account_is_kept_as_poison_not_retried(
    stub_broker: dramatiq.Broker, pg_engine: Engine
):
    stub_broker.add_middleware(InboxMiddleware(pg_engine))
    snippet = load("permanent_failure")
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))

    with running_worker(stub_broker, threads=1) as worker:
        for account, message_id in ((7, "o-7"), (99, "o-99")):
            snippet.add_credit.send_with_options(
                args=(account, 10), **identity(producer="orders", message_id=message_id)
            )
        drain(stub_broker, "default", worker)

    poison = InboxSchema().tables.poison
    with pg_engine.connect() as conn:
        kept = conn.execute(select(poison)).one()
        assert balance(conn, 7) == 10
    assert (kept.message_id, kept.reason_code, kept.attempts) == ("o-99", "unknown_account", 1)
    assert kept.decision == "pending"
    assert kept.payload  # the message itself, for a redrive
    assert [m.options["inbox_message_id"] for m in stub_broker.dead_letters] == ["o-99"]


def test_expired_copies_snippet__a_copy_older_than_the_window_is_not_applied(
    stub_broker: dramatiq.Broker, pg_engine: Engine
):
    snippet = load("expired_copies")
    snippet.add_inbox(stub_broker, pg_engine)

    @dramatiq.actor(inbox_consumer="billing")
    def add_credit(account_id: int, amount: int) -> None:
        current_session().execute(
            text("INSERT INTO accounts VALUES (:id, :amount)"), {"id": account_id, "amount": amount}
        )

    now = datetime.now(UTC)
    with running_worker(stub_broker, threads=1) as worker:
        for account, age in ((7, timedelta(days=1)), (8, timedelta(days=40))):
            add_credit.send_with_options(
                args=(account, 10),
                **identity(producer="orders", message_id=f"o-{account}", produced_at=now - age),
            )
        drain(stub_broker, "default", worker)

    poison = InboxSchema().tables.poison
    with pg_engine.connect() as conn:
        kept = conn.execute(select(poison.c.message_id, poison.c.reason_code)).all()
        assert (balance(conn, 7), balance(conn, 8)) == (10, 0)
    assert [tuple(row) for row in kept] == [("o-8", "expired_redelivery")]


async def test_expired_copies_snippet__faststream_inbox_gets_the_same_window(pg_async_engine):
    inbox = load("expired_copies").faststream_inbox(pg_async_engine)
    assert (inbox.retention_window, inbox.expired_redelivery) == (timedelta(days=30), "reject")


def test_outputs_snippet__a_pipeline_sent_twice_ships_once(
    stub_broker: dramatiq.Broker, pg_engine: Engine
):
    # Given the guide's pipeline of two inbox actors
    stub_broker.add_middleware(InboxMiddleware(pg_engine))
    snippet = load("outputs")
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (5, 10)"))
    # When the same order is placed twice
    with running_worker(stub_broker, threads=1) as worker:
        snippet.place("o-1", 5)
        drain(stub_broker, "default", worker)
        snippet.place("o-1", 5)
        drain(stub_broker, "default", worker)
    # Then one item was taken and shipped once: the duplicate's step was a duplicate too
    with pg_engine.connect() as conn:
        assert balance(conn, 5) == 9
        assert conn.scalar(text("SELECT count(*) FROM ledger WHERE consumer = 'ship'")) == 1


async def test_outputs_snippet__a_reservation_sent_twice_publishes_one_result_twice(
    stub_broker: dramatiq.Broker, pg_async_engine: Any, pg_engine: Engine
):
    # Given the guide's FastStream subscriber, on RabbitMQ
    from inbox_middleware.faststream import FastStreamInbox, identity_headers

    from ..support.faststream_brokers import Harness

    stub_broker.add_middleware(InboxMiddleware(pg_engine))  # the module's Dramatiq actors
    snippet = load("outputs")
    inbox = FastStreamInbox(pg_async_engine)
    h = Harness("rabbit", [inbox.middleware])
    inbox.guard(h.broker)
    orders, shipments = f"{h.source}", f"{h.source}.out"
    snippet.declare_reserve(h.broker, inbox, orders, shipments)
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (5, 10)"))
    headers = identity_headers(producer="shop", message_id="o-1")
    try:
        await h.prepare_destination(shipments)
        async with h.broker:
            await h.broker.start()
            # When the order arrives twice
            await h.publish({"id": 1, "item": 5}, headers)
            await h.publish({"id": 1, "item": 5}, headers)
            sent = await h.read_at_least(shipments, 2)
    finally:
        await h.cleanup()
    # Then one item was taken, and both deliveries published the same result
    with pg_engine.connect() as conn:
        assert balance(conn, 5) == 9
    assert [body for body, _ in sent] == [b'{"order":1,"left":9}'] * 2


def test_scaling_snippets__the_pair_url_finds_the_primary_and_the_queues_are_quorum(
    pg_engine: Engine,
):
    import uuid

    from faststream.rabbit import QueueType

    from ..integration.test_quorum import queue_types
    from ..support import services

    snippet = load("scaling")
    # The failover pair's two servers in one URL: the connection lands on the primary
    hosts = "&".join(f"host={host}:{port}" for host, port in services.pair_addresses())
    engine = snippet.pair_engine(hosts, "postgres")
    try:
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT pg_is_in_recovery()")) is False
    finally:
        engine.dispose()
    # Dramatiq's queue declared by the guide's broker is a quorum queue
    broker = snippet.quorum_broker(pg_engine, services.RABBITMQ)
    name = f"t{uuid.uuid4().hex[:10]}"
    try:
        ping = dramatiq.actor(
            lambda: None, actor_name=f"ping_{name}", queue_name=name, broker=broker
        )
        ping.send()  # Dramatiq declares a queue on its first enqueue
        assert queue_types(name) == {name: "quorum"}
    finally:
        for suffix in ("", ".DQ", ".XQ"):
            broker.channel.queue_delete(f"{name}{suffix}")
        broker.close()
    # FastStream's queue, as the guide declares it
    queue = snippet.quorum_queue("billing")
    assert queue.arguments == {"x-queue-type": QueueType.QUORUM.value, "x-delivery-limit": 20}
