"""The capture's Kafka face: its transactional producer, the offsets committed with each transaction, and the
topics it names and creates. Tools that write as the capture writes (benchmarks, replays) use these."""

from __future__ import annotations

from cdc._kafka import OffsetStore, Topics, TransactionalProducer, TransactionTimedOutError

__all__ = ["OffsetStore", "Topics", "TransactionTimedOutError", "TransactionalProducer"]
