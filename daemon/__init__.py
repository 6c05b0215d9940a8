"""The capture session and the gputraced service."""
