"""Two threads hand a semaphore back and forth: the main thread waits ROUNDS times, each wait ended by the
releaser thread, which sleeps SLEEP_MS before each release (a timer wakes it). The releaser starts its sleep
only once the main thread has reached that round's wait and sleeps in the kernel, and releases only if the
main thread did not wake meanwhile (its voluntary context switches unchanged: it may have been asleep waiting
for the GIL, not yet in the semaphore, and then the releaser sleeps again), so every round is a wait of at
least SLEEP_MS however late a loaded machine runs the main thread (else two releases could meet one wait, and
a round would not block at all, or be cut short by a GIL wait before it).

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
    main_tid = threading.get_native_id()
    reached = [-1]  # the round whose wait the main thread has reached

    def release() -> None:
        for i in range(rounds):
            while True:
                while not (reached[0] == i and _sleeping(main_tid)):
                    time.sleep(0.001)
                switches = _voluntary_switches(main_tid)
                time.sleep(sleep_s)
                if _voluntary_switches(main_tid) == switches:  # asleep all along: in the semaphore
                    break
            sem.release()

    t = threading.Thread(target=release)
    t.start()
    for i in range(rounds):
        reached[0] = i
        sem.acquire()
    t.join()
    print(main_tid, t.native_id, flush=True)


def _sleeping(tid: int) -> bool:
    """Whether thread ``tid`` of this process sleeps (state S in /proc)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def _voluntary_switches(tid: int) -> int:
    """How many times thread ``tid`` of this process went to sleep so far."""
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))


if __name__ == "__main__":
    main(sys.argv[1:])
