"""What sa-fence keeps in PostgreSQL: tokens, the register and its functions,
the guard, pruning, crashes and failover."""
