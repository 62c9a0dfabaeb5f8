"""Model building blocks written for tensor parallelism (size 1 today)."""
