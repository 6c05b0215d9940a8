"""The in-process GPU agent and its channel to the capture session (see docs/agent.md).

Target side: ``arming`` (how a process gets an agent), ``runtime`` (the agent), ``inject`` (attach to a
running Python >= 3.14), ``boot/sitecustomize.py`` (the hook PYTHONPATH points at). Both sides: ``wire``.
Session side helpers for daemon/agents.py: ``validate``, ``listen``. Backends implement ``backend.GpuBackend``.
Importing this package imports nothing else: arming a process must stay cheap.
"""
