"""The listening socket of ``recspec serve``, bound before anything heavy is imported or loaded:
a port in use is one line, ``error: ...``, and exit status 2 (as every user error of ``recspec``),
at once, instead of after the models have loaded. Kept apart from :mod:`recspec.serve.run` so
that binding imports neither torch nor uvicorn."""

from __future__ import annotations

import errno
import socket

from recspec.errors import RecspecError


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one) for the server to listen on; a host
    or port that cannot be bound is a :class:`~recspec.errors.RecspecError`."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise RecspecError(f"--host {host}: not an address of this machine ({err.strerror}); give an IP address "
                           f"or a host name that resolves") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn would: a port in TIME_WAIT is free
    try:
        listener.bind(address)
    except OSError as err:
        listener.close()
        if err.errno == errno.EADDRINUSE:
            raise RecspecError(f"--port {port}: {host}:{port} is already in use; stop what listens there or choose "
                               f"another --port") from None
        raise RecspecError(f"--host {host} --port {port}: cannot listen there ({err.strerror}); choose another "
                           f"address or port") from None
    return listener


def address(listener: socket.socket) -> str:
    """The URL of a bound ``listener``, ``http://HOST:PORT`` (an IPv6 host in brackets)."""
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
