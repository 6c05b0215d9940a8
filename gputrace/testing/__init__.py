"""Helpers for tests and benchmarks, never imported by the tool itself: synthetic captures (``synth``) and a
Perfetto trace checker built on the official protos (``perfetto_check``)."""
