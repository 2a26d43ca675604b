"""`rabbitmqctl` acts on this machine's own node: the test set-up uses it only for a broker
on loopback at the standard port, never for a container mapped to another loopback port."""

from __future__ import annotations

import pytest

from devtools.infra import is_local_node


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("amqp://guest:guest@127.0.0.1:5672/", True),
        ("amqp://guest:guest@localhost/vhost", True),
        ("amqp://guest:guest@[::1]:5672/", True),
        ("amqp://guest:guest@localhost:32771/", False),  # a testcontainers RabbitMQ
        ("amqp://guest:guest@rabbit.internal:5672/", False),
    ],
)
def test_only_the_standard_loopback_port_is_the_local_node(url: str, local: bool) -> None:
    assert is_local_node(url) is local
