"""The ``oneblock`` command."""
