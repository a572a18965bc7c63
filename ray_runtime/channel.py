"""The control plane between the driver and each stage: one TCP connection per stage,
carrying length-prefixed frames, so a step costs a socket write and read instead of a Ray
actor call (~1 ms) and no `ray.get` sits in the step loop.

The stage listens on its node's address (never on all interfaces) at a port the OS picks,
and the driver connects to it; the same path works on one node and across nodes. Frames
keep their order, and a stage answers every plan frame with exactly one frame, result or
error, in plan order: the driver matches replies to plans by position alone.
"""
from __future__ import annotations

import select
import socket
import struct
from typing import Optional

PLAN, RESULT, ERROR, STOP = 1, 2, 3, 4
_HEADER = struct.Struct("!IB")  # payload length, frame kind


class ChannelClosed(ConnectionError):
    """The peer closed the connection (its process died or its loop stopped)."""


class StageError(RuntimeError):
    """A stage raised while running a step; the message carries its traceback."""


class Channel:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer  # for error messages: "stage rank 1 at 10.0.0.2:41234"

    @classmethod
    def connect(cls, host: str, port: int, peer: str, timeout_s: float = 30.0) -> "Channel":
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.settimeout(None)
        return cls(sock, peer)

    def send(self, kind: int, payload: bytes = b"") -> None:
        try:
            self.sock.sendall(_HEADER.pack(len(payload), kind) + payload)
        except OSError as e:
            raise ChannelClosed(f"{self.peer}: channel closed while sending ({e})") from None

    def readable(self, timeout_s: float = 0.0) -> bool:
        """Whether a frame (or the peer's close) is waiting, within timeout_s."""
        return bool(select.select([self.sock], [], [], timeout_s)[0])

    def peer_closed(self) -> bool:
        """Whether the peer has closed its end (nothing left to read but the end), without
        consuming anything."""
        if not self.readable(0.0):
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def recv(self, timeout_s: Optional[float] = None) -> tuple[int, bytes]:
        """The next frame. timeout_s: raise TimeoutError if none starts within it."""
        if timeout_s is not None and not self.readable(timeout_s):
            raise TimeoutError(f"{self.peer}: no reply within {timeout_s:.1f}s")
        length, kind = _HEADER.unpack(self._read_exact(_HEADER.size))
        return kind, self._read_exact(length) if length else b""

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except OSError as e:
                raise ChannelClosed(f"{self.peer}: channel closed ({e})") from None
            if k == 0:
                raise ChannelClosed(f"{self.peer}: the peer closed the channel (its process "
                                    "died or its step loop stopped)")
            got += k
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Listener:
    """A stage's end: bound to the node's address at an OS-chosen port, accepting one driver."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(1)
        self.address = (host, self.sock.getsockname()[1])

    def accept(self, peer: str, timeout_s: float = 60.0) -> Channel:
        self.sock.settimeout(timeout_s)
        conn, _ = self.sock.accept()
        conn.settimeout(None)
        self.sock.close()
        return Channel(conn, peer)
