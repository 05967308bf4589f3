"""Alembic environment: the schema `rollbook` is created only by these migrations."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

SCHEMA = "rollbook"

config = context.config
url = config.get_main_option("sqlalchemy.url")
engine = create_engine(url)
with engine.connect() as connection:
    connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
    connection.commit()
    context.configure(connection=connection, version_table_schema=SCHEMA, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
