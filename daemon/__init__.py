"""The collecting side: the capture session and what serves it.

``session`` (starts the sources, writes the capture file, ends cleanly), ``targets`` (what it is pointed at, checked
first), ``launch`` (``-- CMD`` held at a handshake), ``writer`` (the bounded queue into the capture file), ``cost``
(what the capture costs the host), ``finish`` (analyse and export when it ends); ``agents`` (the session's side of the
in-process agents' channel), ``attach`` (putting an agent into a running Python); ``service`` (gputraced, which runs
sessions for local users). ``gputrace capture`` runs a session in its own process; gputraced runs one per request.
"""
