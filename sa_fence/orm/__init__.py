"""The ORM side: the ``Fenced`` mixin and fence column (:mod:`.model`), the
rewrite of fenced DML into token-compared statements (:mod:`.rewrite`), what
sa-fence keeps on a session (:mod:`.session_state`), the statement hook on its
connections (:mod:`.statements`), the session events and ``install``/``bind``
(:mod:`.flush`), and ``create_fence_guard`` (:mod:`.create_guard`).
"""
