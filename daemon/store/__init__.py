"""Durable state of the coordinator: a narrow revisioned key-value store (etcd in production)."""
