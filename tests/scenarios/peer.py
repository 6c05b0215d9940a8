"""A slow TCP peer: prints its port, then answers every request line after DELAY_MS (one client).

    python peer.py DELAY_MS
"""

from __future__ import annotations

import socket
import sys
import time


def main() -> None:
    delay_s = float(sys.argv[1]) / 1e3
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        print(ls.getsockname()[1], flush=True)
        conn, _ = ls.accept()
        buf = b""
        with conn:
            while data := conn.recv(4096):
                buf += data
                while b"\n" in buf:
                    _, buf = buf.split(b"\n", 1)
                    time.sleep(delay_s)
                    conn.sendall(b"x" * 4096 + b"\n")


if __name__ == "__main__":
    main()
