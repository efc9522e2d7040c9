"""Alembic environment and versions for the zoo schema (shipped in the wheel for `zoo init`)."""
