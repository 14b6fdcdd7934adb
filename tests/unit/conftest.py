"""Fixtures for the unit tier: ``cli`` runs ``areal-async ARGS`` in the test's own process (tests/support/cli.py)."""

from tests.support.cli import cli  # noqa: F401 (a fixture: found here by name)
