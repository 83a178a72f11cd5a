"""Lease scope: the arm, the commit check, and every way a transaction can end."""
