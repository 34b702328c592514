"""The part of an Alembic ``env.py`` that keeps autogenerate away from the inbox tables."""

from alembic import context

from inbox_middleware.storage import InboxSchema, exclude_inbox_tables

target_metadata = None  # your models' MetaData


def configure(connection: object) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_object=exclude_inbox_tables(InboxSchema(schema="inbox")),
    )
