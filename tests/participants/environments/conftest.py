"""Fixtures the environments' tests share."""

from tests.participants.environments.test_gym_http import closed_clients, recorder  # noqa: F401 - a NeMo Gym server's HTTP, recorded

__all__ = ["closed_clients", "recorder"]
