"""Two threads hand a semaphore back and forth: the main thread waits ROUNDS times, each wait ended by the
releaser thread, which sleeps SLEEP_MS before each release (a timer wakes it).

    python handoff.py [ROUNDS] [SLEEP_MS] [--gate]

With --gate it waits for a line on stdin before starting. Prints ``MAIN_TID RELEASER_TID`` at the end.
"""

from __future__ import annotations

import sys
import threading
import time


def main(argv: list[str]) -> None:
    gate = "--gate" in argv
    args = [a for a in argv if a != "--gate"]
    rounds = int(args[0]) if args else 10
    sleep_s = (float(args[1]) if len(args) > 1 else 30) / 1000
    if gate:
        sys.stdin.readline()
    sem = threading.Semaphore(0)

    def release() -> None:
        for _ in range(rounds):
            time.sleep(sleep_s)
            sem.release()

    t = threading.Thread(target=release)
    t.start()
    for _ in range(rounds):
        sem.acquire()
    t.join()
    print(threading.get_native_id(), t.native_id, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
