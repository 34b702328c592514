"""An Alembic revision that creates (or upgrades) the inbox tables.

Copy it into your project's ``versions/`` folder and set ``revision`` and
``down_revision`` to fit your history. ``migrate`` joins Alembic's transaction, records
the inbox versions in its own table, and does nothing when they are already applied.
"""

from alembic import op

from inbox_middleware.storage import InboxSchema, migrate

revision = "0001_inbox"
down_revision = None

# Where the tables go: the same naming the middleware is given.
INBOX = InboxSchema(schema="inbox")


def upgrade() -> None:
    migrate(op.get_bind(), INBOX)


def downgrade() -> None:
    raise RuntimeError("dropping the inbox would make every old delivery new again")
