"""Scheduling and KV-memory bookkeeping: pure Python, no model imports, testable without a model."""
