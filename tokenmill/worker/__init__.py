"""Turning a SchedulerOutput into tensors, running the model, sampling."""
