"""A TCP proxy on loopback that can cut every connection through it, to test what clients do
when a connection drops while the broker lives on."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class CuttingProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.cuts = 0
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._stop = False
        self._frozen: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._selector.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    self._accept()
                    continue
                with self._lock:
                    peer = self._pairs.get(sock)
                if peer is None or sock in self._frozen:
                    continue
                try:
                    data = sock.recv(262144)
                    if data:
                        peer.sendall(data)
                        continue
                except OSError:
                    pass
                self._close_pair(sock)

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._pairs[client] = upstream
            self._pairs[upstream] = client
        self._selector.register(client, selectors.EVENT_READ)
        self._selector.register(upstream, selectors.EVENT_READ)

    def _close_pair(self, sock: socket.socket) -> None:
        with self._lock:
            peer = self._pairs.pop(sock, None)
            if peer is not None:
                self._pairs.pop(peer, None)
        for s in (sock, peer):
            if s is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(s)
            s.close()

    def freeze(self) -> None:
        """Stop forwarding on every current connection, leaving it open: a hung peer. New
        connections work normally."""
        with self._lock:
            self._frozen.update(self._pairs)
        for sock in list(self._frozen):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)

    def cut(self) -> None:
        """Reset every connection through the proxy (in flight data is lost both ways)."""
        with self._lock:
            socks = list(self._pairs)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
            self._close_pair(sock)
        self.cuts += 1

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.cut()
        self.listener.close()
