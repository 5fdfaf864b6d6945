"""Shared fixtures live in tests/fixtures/, one module per real component."""

pytest_plugins = [
    "tests.fixtures.procs",
    "tests.fixtures.redis",
    "tests.fixtures.sim",
    "tests.fixtures.router",
    "tests.fixtures.probes",
]
