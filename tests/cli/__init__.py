"""The sa-fence command: check, status, prune, demo and bench."""
