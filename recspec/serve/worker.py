"""Decoding in its own process (``recspec serve --decode-process``).

In-process, the batcher's decode thread and the event loop share one interpreter lock: a decode
bound by Python work (a GPU's kernels launched one by one) keeps the event loop waiting each time
it wants to run. Here the batches go to a worker process that loads the same service
(:func:`~recspec.serve.config.load_service`) and decodes them; the server's process loads only what
checking and parsing requests before they queue needs (the tokenizer, item index and trie, on the
CPU, one thread; no model weights).

Across the pipe (a ``multiprocessing`` pipe of the ``spawn`` context) only bytes travel,
``send_bytes`` / ``recv_bytes``, never a pickle of a request or an answer:

* worker to server, once loaded and warm: ``{"ready": true, "threads": N}`` or ``{"failed": "..."}``;
* server to worker: a JSON header ``{"op": "decode", "k", "decoder", "exclude", "lengths"}`` then the
  batch's prompts as one int64 array (concatenated; ``lengths`` splits it), answered by
  ``{"answers": [...]}`` (:class:`~recspec.serve.service.Answer` fields) or ``{"error": "..."}``;
  or ``{"op": "choices"}``, answered by ``{"choices": [...]}`` (``auto``'s choices made so far).

The worker ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group; the server stops
gracefully and answers what is in flight, so its worker must go on decoding) and exits when the
server closes the pipe, or dies.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import threading
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from recspec.errors import RecspecError
from recspec.serve.config import ServeConfig, load_service

log = logging.getLogger("recspec.serve")

#: How long the server waits for its worker to stop once it closed the pipe (seconds).
STOP_SECONDS = 10.0


class WorkerGone(RuntimeError):
    """The decode worker process exited; nothing more can be decoded."""


def _send(connection: Connection, message: dict[str, Any]) -> None:
    connection.send_bytes(json.dumps(message).encode())


def _receive(connection: Connection) -> dict[str, Any]:
    return json.loads(connection.recv_bytes())


class DecodeWorker:
    """The server's side of a decode worker process over ``config`` (module doc): :meth:`start`
    it, wait until it is ready, then :meth:`decode` batches from one thread at a time (a lock orders the calls)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.threads = 0  # the worker's torch threads, once ready
        self._lock = threading.Lock()
        context = multiprocessing.get_context("spawn")
        self._connection, theirs = context.Pipe()
        self._process = context.Process(target=run_worker, args=(theirs, config.settings()),
                                        name="recspec-decode", daemon=True)
        self._theirs = theirs

    def start(self) -> None:
        """Start the worker process (it loads the models meanwhile: :meth:`wait_ready`)."""
        self._process.start()
        self._theirs.close()  # the worker's end lives in the worker: its exit is our end of file

    def wait_ready(self) -> None:
        """Wait until the worker has loaded the models and warmed up; a worker that fails or exits
        first raises :class:`~recspec.errors.RecspecError` with its reason."""
        try:
            ready = _receive(self._connection)
        except (EOFError, OSError):
            self._process.join(STOP_SECONDS)
            raise RecspecError(f"the decode worker exited while loading (status {self._process.exitcode})") from None
        if "failed" in ready:
            raise RecspecError(ready["failed"])
        self.threads = int(ready["threads"])

    def decode(self, queries: list[Any]) -> list[Any]:
        """Decode ``queries`` (one key; :meth:`RecommendService.decode`) in the worker."""
        from recspec.serve.service import Answer

        first = queries[0]
        prompts = [query.prompt.numpy().astype(np.int64, copy=False) for query in queries]
        header = {"op": "decode", "k": first.k, "decoder": first.decoder, "exclude": list(first.exclude),
                  "lengths": [len(prompt) for prompt in prompts]}
        reply = self._call(header, np.concatenate(prompts).tobytes())
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return [Answer(**answer) for answer in reply["answers"]]

    def auto_choices(self) -> list[dict[str, Any]]:
        """``auto``'s choices the worker has made so far."""
        return self._call({"op": "choices"})["choices"]

    def _call(self, header: dict[str, Any], payload: bytes | None = None) -> dict[str, Any]:
        with self._lock:
            try:
                _send(self._connection, header)
                if payload is not None:
                    self._connection.send_bytes(payload)
                return _receive(self._connection)
            except (EOFError, OSError):
                self._process.join(STOP_SECONDS)
                raise WorkerGone(f"the decode worker process exited (status {self._process.exitcode})") from None

    def close(self) -> None:
        """Close the pipe (the worker then exits) and wait for it; kill it if it does not stop."""
        self._connection.close()
        if self._process.pid is None:
            return
        self._process.join(STOP_SECONDS)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def run_worker(connection: Connection, settings: str) -> None:
    """The worker process: load the service of ``settings`` (:meth:`ServeConfig.settings`), warm
    it up, say so, then answer the server's messages until it closes the pipe (module doc)."""
    import torch

    from recspec.serve.service import Query

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    config = ServeConfig.from_settings(settings)
    try:
        service = load_service(config)
        service.warm_up(config.auto_k[0])
        reply: dict[str, Any] = {"ready": True, "threads": torch.get_num_threads()}
    except Exception as err:  # noqa: BLE001 - told to the server, which stops
        reply = {"failed": str(err) or type(err).__name__}
    try:
        _send(connection, reply)
    except OSError:  # the server stopped while this loaded
        return
    if "failed" in reply:
        return
    while True:
        try:
            header = _receive(connection)
            if header["op"] == "choices":
                _send(connection, {"choices": service.auto_choices()})
                continue
            flat = np.frombuffer(connection.recv_bytes(), dtype=np.int64)
        except (EOFError, OSError):  # the server closed the pipe, or is gone
            return
        bounds = np.cumsum([0, *header["lengths"]])
        queries = [Query(torch.from_numpy(flat[start:end].copy()), header["k"], header["decoder"],
                         tuple(header["exclude"])) for start, end in zip(bounds[:-1], bounds[1:])]
        try:
            reply = {"answers": [asdict(answer) for answer in service.decode(queries)]}
        except Exception as err:  # noqa: BLE001 - one failed batch fails its requests, not the worker
            log.exception("recspec serve: a batch failed in the decode worker")
            reply = {"error": str(err) or type(err).__name__}
        _send(connection, reply)
