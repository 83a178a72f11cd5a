"""Decorators, side effects, Alembic, telemetry and the recipes."""
