"""The eBPF source (bcc): its programs (probes/bpf/), how they are built (``build``), attached (``hooks``), checked
against the host (``host``, ``btf``), limited to what a capture's owner may see (``owner``), run (``source``) and read
when the capture stops (``final``), plus their cost (``bpfstats``). Decoding what they recorded is pure Python that
every reader of a capture runs: ``events``, with ``syscalls``, ``uring``, ``epolls``, ``fdtable``, ``filemaps``,
``overlay``. Importing this package imports nothing else.
"""
