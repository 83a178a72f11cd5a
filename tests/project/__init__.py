"""The project itself: docs pages run as written, packaging, layering, typing,
the SQLAlchemy suite's comparison, test hygiene."""
