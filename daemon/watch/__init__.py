"""gputraced's watch mode: GPU jobs found as they start, each traced into a flight recorder (watcher.py)."""
