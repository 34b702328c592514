"""An Alembic ``env.py``: online and offline (``--sql``) runs, with autogenerate kept away
from the inbox tables (the library's own migrations own them)."""

from alembic import context
from myapp.models import Base  # your models
from sqlalchemy import engine_from_config, pool

from inbox_middleware import InboxSchema, exclude_inbox_tables

# The same naming the middleware and the inbox revision are given.
INBOX = InboxSchema()

options = {
    "target_metadata": Base.metadata,
    "include_object": exclude_inbox_tables(INBOX),
}

if context.is_offline_mode():
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"), literal_binds=True, **options
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = engine_from_config(
        context.config.get_section(context.config.config_ini_section, {}),
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with engine.connect() as connection:
        context.configure(connection=connection, **options)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()
