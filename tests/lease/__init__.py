"""The lease: acquire, renew, release and loss, on both front ends; Redis failures and budgets."""
