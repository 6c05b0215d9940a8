"""The session's side of the agent channel: the socket agents connect to, what each peer may send, and whose ids it
reports. ``server`` (one selector thread for every peer), ``peer`` (one agent's state), ``listen`` (listening
sockets, also inside a container's root), ``validate`` (checks on every frame), ``pidns`` (an agent's ids against the
host's), ``sockdir`` (the socket directory a later session can recognise as stale).
"""
