"""Viewers: the Perfetto UI, HTML and terminal reports."""
