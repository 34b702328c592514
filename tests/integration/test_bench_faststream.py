"""The FastStream benchmark's floor mode (the guarantee's statements alone, in a real
`faststream run` worker on RabbitMQ) and the server's share of the claim
(`bench.claim_server`)."""

from __future__ import annotations

import pytest
from bench import faststream_bench
from bench.common import admin, prepare_database

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["floor", "floor_sync"])
def test_faststream_bench__the_floor_claims_each_message_once_and_tells_the_cpu(mode: str) -> None:
    # Given the benchmark's database
    prepare_database()
    # When the floor's worker (the update awaited, or all in one run_sync) consumes 300
    # messages published with their identity
    measured = faststream_bench.throughput(mode, 300)
    # Then it told its rate, its worker's CPU a message and the server's (on this host,
    # counted in clock ticks: enough messages for a few)
    assert isinstance(measured, tuple), measured
    rate, worker_us, server_us = measured
    assert rate > 0 and worker_us > 0 and server_us > 0
    # And each message was claimed and applied once
    with admin() as conn:
        claims = conn.execute("SELECT count(*) FROM consumer_inbox").fetchone()
        applied = conn.execute("SELECT sum(balance) FROM bench_accounts").fetchone()
    assert (claims, applied) == ((300,), (300,))


def test_claim_server__tells_the_server_cpu_of_each_part(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import claim_server

    # When each variant runs a few hundred transactions (the library's own claim among them)
    assert claim_server.main(["--transactions", "400", "--reps", "1"]) == 0
    # Then each tells its rate and the server's CPU a transaction
    out = capsys.readouterr().out
    rows = {line[:32].strip(): line[32:].split() for line in out.splitlines()[1:]}
    assert set(rows) == set(claim_server.variants()[1])
    assert all(float(rate) > 0 and float(cpu) >= 0 for rate, cpu, *_ in rows.values())
