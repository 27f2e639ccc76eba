"""Which of Kafka's answers no retry can change, for the capture and the sinks alike: a permission, a name or a
setting someone has to fix. Named as librdkafka names its error codes (``KafkaError.name()``), so this layer
needs no Kafka client. Every other answer (a broker not reachable, a controller or leader moving, a timeout) is
worth retrying."""

from __future__ import annotations

NOT_AUTHORISED = frozenset(
    {
        "TOPIC_AUTHORIZATION_FAILED",
        "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
        "CLUSTER_AUTHORIZATION_FAILED",
        "GROUP_AUTHORIZATION_FAILED",
        "_AUTHENTICATION",
    }
)
# Creating a topic: a name, a setting or a broker policy the cluster refuses.
SETTING_REFUSED = frozenset(
    {
        "TOPIC_EXCEPTION",
        "INVALID_REPLICATION_FACTOR",
        "INVALID_PARTITIONS",
        "INVALID_CONFIG",
        "POLICY_VIOLATION",
    }
)


def refused(name: str, *, fatal: bool = False) -> bool:
    """Whether Kafka's answer ``name`` (or a fatal error of librdkafka's) needs a fix, not a retry."""
    return fatal or name in NOT_AUTHORISED or name in SETTING_REFUSED
