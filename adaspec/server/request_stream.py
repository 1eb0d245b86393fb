"""What one request's consumer holds on the event loop: its `RequestStream` of engine outputs
(fed by `AsyncEngine`, see its module for the threading contract) and `EngineError`, which a
stream raises when the engine fails the request for an internal reason."""
from __future__ import annotations

import asyncio
import concurrent.futures

from adaspec.engine.request import RequestOutput


class EngineError(RuntimeError):
    """The engine failed a request for an internal reason (not the client's fault)."""


class RequestStream:
    """The outputs of one engine request, consumed with `async for` on the event loop.

    Iteration yields incremental `RequestOutput`s and stops after the finished one; it raises
    `EngineError` if the request failed. Timestamps (monotonic seconds) feed the latency metrics.
    """

    def __init__(self, request_id: str, arrival: float):
        self.request_id = request_id
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished = False
        self.prompt_token_ids: list[int] = []
        self.last_output: RequestOutput | None = None
        self._accepted: concurrent.futures.Future | None = None
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item
