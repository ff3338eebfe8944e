"""serving package (see README)."""
