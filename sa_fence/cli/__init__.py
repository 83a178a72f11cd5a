"""The tools: the ``sa-fence`` command and what its subcommands run.

``check``, ``repair-sequence``, ``status``, ``prune``, ``create-guard``,
``bench`` and ``demo`` (with the demo's own models) live here, outside the
library.  They depend on the core (every other module of ``sa_fence``); the
core never imports them (``tests/project/test_layering.py``).  The command line is the
interface; the modules' names may change between releases.
"""
