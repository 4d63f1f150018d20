"""Messaging: the bus protocol and its implementations. Imports no torch."""

from rollart.bus.base import (
    Bus,
    BusError,
    BusTimeout,
    ConsumerSpec,
    Delivery,
    DuplicateConflict,
    KeyValue,
    KVEntry,
    NoResponders,
    ObjectStore,
    ObjectTooLarge,
    PullConsumer,
    Request,
    Retention,
    StreamSpec,
    Subscription,
)

__all__ = [
    "Bus", "BusError", "BusTimeout", "ConsumerSpec", "Delivery", "DuplicateConflict", "KeyValue", "KVEntry",
    "NoResponders", "ObjectStore", "ObjectTooLarge", "PullConsumer", "Request", "Retention", "StreamSpec",
    "Subscription",
]
