"""Shared pytest fixtures. Helpers live in tests/support; unit tests in tests/unit run without
starting a daemon, tests/e2e start real daemon processes (and redis-server) on loopback."""

from tests.support.redis_server import redis_server, redis_url  # noqa: F401 - fixtures
