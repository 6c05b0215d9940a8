"""The in-process GPU agent: the code that runs inside a traced process (see docs/agent.md).

``arming`` (how a process gets an agent: from its environment, dormant until offered, or injected), ``runtime`` (the
agent: one connection, a bounded queue, one I/O thread), ``threads`` (the threads it starts), ``boot/sitecustomize.py``
(the hook PYTHONPATH points at), ``wire`` and ``minipack`` (the channel's format, shared with the session's side in
gputrace.daemon.agents). Backends implement ``backend.GpuBackend``. Importing this package imports nothing else:
arming a process must stay cheap.
"""
