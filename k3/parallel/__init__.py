"""Parallelism applied to a finished model from outside (report §5.1.2, §5.2); the model imports nothing from here."""
