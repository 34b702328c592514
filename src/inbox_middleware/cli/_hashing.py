"""``inbox-middleware hash``: the canonical form and digest of a payload given on stdin.

For operators checking a stored ``payload_sha256`` (``status --payload-sha256``) and for
producers in other languages checking their own implementation of the hash scheme.
"""

from __future__ import annotations

import hashlib
import sys

import click

from .._core.canonical import NotJSON, canonical_json, loads
from .._core.exceptions import PayloadNotHashable

__all__ = ["hash_command"]


@click.command("hash")
@click.option(
    "--actor",
    metavar="NAME",
    default=None,
    help="Hash as a Dramatiq consumer does (dramatiq.v2): stdin holds the actor's arguments "
    'by parameter name, {"account_id": 7, "amount": 10}. Without it, stdin is the '
    "message body, hashed as a FastStream consumer does (faststream-json.v2).",
)
def hash_command(actor: str | None) -> None:
    """Print the canonical form (RFC 8785) and SHA-256 of the JSON payload on stdin.

    The first line is the canonical JSON, the second its hex digest: the payload_sha256
    the inbox stores for that payload. A body that is not JSON is hashed by FastStream
    consumers as its bytes (sha256sum gives that digest).
    """
    data = sys.stdin.buffer.read()
    try:
        value = loads(data)
        if actor is not None:
            if not isinstance(value, dict):
                raise click.UsageError("with --actor, stdin must be a JSON object of arguments")
            value = {"actor": actor, "args": value}
        canonical = canonical_json(value)
    except NotJSON as exc:
        raise click.ClickException(f"stdin is not JSON text: {exc}") from None
    except PayloadNotHashable as exc:
        raise click.ClickException(f"the payload has no canonical form: {exc}") from None
    click.echo(canonical.decode("utf-8"))
    click.echo(hashlib.sha256(canonical).hexdigest())
