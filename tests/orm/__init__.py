"""The ORM side: the flush hook, statement rewriting, inheritance,
relationships, upserts, session binds."""
