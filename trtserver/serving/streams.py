"""Several async iterators as one, items tagged with their source's index, interleaved as they arrive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def merge_streams(sources: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield ``(source index, item)``; an error in any source is raised here; closing this early
    cancels every source (so each engine request is aborted)."""
    if len(sources) == 1:  # the common case needs no tasks
        source = sources[0]
        try:
            async for item in source:
                yield 0, item
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
        return
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                queue.put_nowait((index, item))
        except BaseException as exc:  # handed to the consumer
            queue.put_nowait(exc)
            raise
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    try:
        running = len(tasks)
        while running:
            entry = await queue.get()
            if entry is None:
                running -= 1
            elif isinstance(entry, BaseException):
                raise entry
            else:
                yield entry
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
