"""The listening socket of a oneblock server: bound before the app is built (its port names the server in the
``Host`` check), printed as a URL, and recognised as loopback or not."""

from __future__ import annotations

import ipaddress
import socket


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(64)
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://HOST:PORT/`` of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
