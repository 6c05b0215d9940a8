"""The Perfetto exporter: ``export`` (the record handlers and the streaming writer), ``tracks`` and ``canvas`` (where
it draws), ``links`` (flows), ``samples`` (CPU stack samples), ``args`` (names and annotations), ``proto`` (the
TracePacket encoder)."""
