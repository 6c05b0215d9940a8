"""Helper programs and fixtures for tests that run real workloads (importable as ``workloads``)."""
