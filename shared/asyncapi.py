"""The AsyncAPI document of every message, built from the contracts and the topology.

`python -m shared.asyncapi > docs/asyncapi.json` regenerates the committed copy; the gateway
also serves it at `/asyncapi.json`. A contract appears on every exchange whose bindings
route its routing key to a work queue, so the document cannot drift from the topology.
"""

from __future__ import annotations

import sys
from typing import Any

from faststream.rabbit import RabbitBroker, RabbitExchange
from faststream.specification import AsyncAPI

from shared import contracts, topology

TITLE = "Scorebox messages"


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching: `*` is one word, `#` zero or more."""
    return _match(pattern.split("."), routing_key.split("."))


def _match(pattern: list[str], words: list[str]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head in ("*", words[0])) and _match(rest, words[1:])


def message_contracts() -> list[type[contracts.Contract]]:
    """Every concrete contract that is published under a routing key of its own."""
    found = []
    for value in vars(contracts).values():
        if (
            isinstance(value, type)
            and issubclass(value, contracts.Contract)
            and value is not contracts.Contract
            and value is not contracts.TaskEvent
            and isinstance(getattr(value, "routing_key", None), str)
        ):
            found.append(value)
    return found


# The queues of one replica each, bound while it runs (`shared.topology`): named here with
# a placeholder for the replica, as the document's reader would look for them.
REPLICA_QUEUES: tuple[tuple[str, topology.Binding], ...] = (
    (
        f"{topology.LIVE_EVENTS_PREFIX}<replica> (gateway, while requests wait)",
        topology.Binding(topology.EVENTS, topology.LIVE_EVENTS_BINDING),
    ),
    (f"{topology.SCORER_PAUSES_PREFIX}<replica> (scorer)", topology.SCORER_PAUSES_BINDING),
    (
        f"{topology.SCORER_BATCH_CANCELS_PREFIX}<replica> (scorer)",
        topology.SCORER_BATCH_CANCELS_BINDING,
    ),
)


# Contracts also published under another routing key than their own: (contract, key, what).
SECOND_ROUTES: tuple[tuple[type[contracts.Contract], str, str], ...] = (
    (
        contracts.ScoreText,
        contracts.ScoreText.resubmission_routing_key,
        "Sent again (a re-score, a dead-letter replay, a scorer's own re-send or retry): to "
        "the scorer alone.",
    ),
    *(
        (
            event,
            topology.USAGE_RETRY_ROUTING_KEY,
            "A usage event the scheduler's meter could not store, sent back to it through "
            "the wait ladder.",
        )
        for event in (contracts.TaskCompleted, contracts.TaskFailed)
    ),
)


def _routes(routing_key: str) -> list[tuple[RabbitExchange, str]]:
    """(exchange, queue) pairs a message with this routing key reaches."""
    routes = [
        (binding.exchange, name)
        for name, binding in REPLICA_QUEUES
        if topic_matches(binding.routing_key, routing_key)
    ]
    bound: tuple[topology.WorkQueue | topology.RecentLog, ...] = (
        *topology.WORK_QUEUES,
        topology.OPS_LOG,
    )
    for work_queue in bound:
        for binding in work_queue.bindings:
            if binding.exchange.name in (topology.DUE.name, topology.DLX.name):
                continue
            if binding.exchange.name == topology.CALLBACKS.name:
                # Reached through `scorebox.events`, then by header, not by routing key.
                if binding.arguments == topology.NOTIFY_WITH_CALLBACK and topic_matches(
                    topology.CALLBACK_EVENT_KEY, routing_key
                ):
                    condition = f"{topology.CALLBACK_HEADER}: {topology.CALLBACK_HEADER_VALUE}"
                    routes.append((topology.EVENTS, f"{work_queue.name} (with {condition})"))
                continue
            if topic_matches(binding.routing_key, routing_key):
                routes.append((binding.exchange, work_queue.name))
    return routes


def build_broker() -> RabbitBroker:
    """A broker that is never connected: it only carries the specification."""
    broker = RabbitBroker()
    for contract in message_contracts():
        routing_key: str = contract.routing_key  # type: ignore[attr-defined]
        _describe(broker, contract, routing_key, (contract.__doc__ or "").strip())
    for contract, routing_key, what in SECOND_ROUTES:
        # One channel per contract: the two events of `usage.retry` would share a name.
        _describe(broker, contract, routing_key, what, named=f" ({contract.__name__})")
    return broker


def _describe(
    broker: RabbitBroker,
    contract: type[contracts.Contract],
    routing_key: str,
    summary: str,
    *,
    named: str = "",
) -> None:
    routes = _routes(routing_key)
    exchanges = {exchange.name: exchange for exchange, _ in routes}
    queues = ", ".join(sorted(queue for _, queue in routes))
    for exchange in exchanges.values():
        broker.publisher(
            exchange=exchange,
            routing_key=routing_key,
            schema=contract,
            title=f"{exchange.name}:{routing_key}{named}",
            description=f"{summary} Consumed from: {queues}.",
        )


def build_document() -> dict[str, Any]:
    spec = AsyncAPI(build_broker(), title=TITLE, version=str(contracts.SCHEMA_VERSION))
    document: dict[str, Any] = spec.to_specification().to_jsonable()
    return document


def main() -> None:
    import json  # noqa: PLC0415

    sys.stdout.write(json.dumps(build_document(), indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
