"""Putting an agent into a running, unarmed Python process, from the session's side.

``inject`` picks the way (``sys.remote_exec`` on Python >= 3.14, else ``pyattach``, a ptrace injector of ours for
CPython 3.9 to 3.13); ``symbols`` finds the interpreter's functions in the target's ELF files; ``nsexec`` runs a helper
with the target's credentials, in its namespaces and under its root. The code that runs inside the target is
``gputrace.agent``.
"""
