"""Engine and request statistics, and their Prometheus exporters."""
