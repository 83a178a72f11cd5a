"""What sa-fence keeps in PostgreSQL, and the SQL that reads and moves it.

The token sequence (:mod:`.tokens`), the lease register and its functions
(:mod:`.register`), the guard trigger and the SQL text shared by every check
(:mod:`.guard`), the fitness rules the sequence and register must meet
(:mod:`.fitness`), pruning (:mod:`.prune`), who blocks a grant (:mod:`.blockers`)
and the dialect check (:mod:`.dialect`).  Nothing here knows of Redis, the ORM
or a lease's lifecycle.
"""
