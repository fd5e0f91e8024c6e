"""A keyless client flooding a TCP port with idle connections, as the red team's did (issue 37).

`Flooder(host, port, count)` keeps `count` plain TCP connections open to host:port from one thread,
sending nothing; whenever the server closes (or resets, or refuses) one, it opens another at once.
Bounded in count (never more than `count` open) and in time (it stops by itself after `limit_s`);
`stop()` closes every connection and waits for the thread. `reopened` counts the connections the
server accepted and then ended, the measure of how hard the flood pressed; `refused` those it refused.
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time


class Flooder:
    def __init__(self, host: str, port: int, count: int, *, limit_s: float = 120.0) -> None:
        self.address, self.count = (host, port), count
        self.reopened = 0
        self.refused = 0
        self.peak = 0  # the most connections open (connected or connecting) at once
        self._until = time.monotonic() + limit_s
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, name="bulk-flood", daemon=True)

    def __enter__(self) -> Flooder:
        for _ in range(self.count):
            self._open()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _open(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex(self.address)
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            return  # refused at once: the next round opens it again
        self._selector.register(sock, selectors.EVENT_READ)
        self.peak = max(self.peak, len(self._selector.get_map()))

    def _run(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._until:
            for key, _ in self._selector.select(0.05):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    if sock.recv(1 << 12):  # the server wrote to a stranger: keep reading, count nothing
                        continue
                    self.reopened += 1
                except ConnectionRefusedError:
                    self.refused += 1
                except OSError:  # reset
                    self.reopened += 1
                self._selector.unregister(sock)
                sock.close()
            for _ in range(self.count - len(self._selector.get_map())):
                self._open()
