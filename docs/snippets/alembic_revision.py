"""An Alembic revision that creates (or upgrades) the inbox tables.

Copy it into your project's ``versions/`` folder and set ``revision`` and
``down_revision`` to fit your history. ``migrate`` joins Alembic's transaction, records
the inbox versions in its own table, and does nothing when they are already applied; in
offline mode (``alembic upgrade head --sql``) it prints the statements instead.
"""

from alembic import context, op

from inbox_middleware import InboxSchema, drop_inbox, migrate

revision = "0001_inbox"
down_revision = None

# Where the tables go: the same naming the middleware is given.
INBOX = InboxSchema()


def upgrade() -> None:
    migrate(op.get_bind(), INBOX)


def downgrade() -> None:
    # Dropping the inbox forgets every claim: each message delivered again afterwards
    # would be processed again. So only when asked: alembic -x drop_inbox=yes downgrade
    asked = context.get_x_argument(as_dictionary=True).get("drop_inbox") == "yes"
    drop_inbox(op.get_bind(), INBOX, confirm=asked)
