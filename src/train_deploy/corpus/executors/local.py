"""The local executor (``corpus.encoding.executor: local``): this process and ``workers - 1`` spawned helpers.

All of them take the next unclaimed chunk from a shared cursor, so the load balances itself and this process
starts encoding at once while the helpers are still starting up. A helper's error is raised here; a helper that
dies (the OOM killer) fails the stage within a batch, naming its chunk. Helpers are watched through their result
pipes and exit status, not a ``Pool``: a pool replaces a worker that dies and waits forever for the chunks it held.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.encode import ChunkEncoder, ChunkResult, chunk_place
from train_deploy.corpus.errors import CorpusError
from train_deploy.corpus.executors.progress import EncodingProgress
from train_deploy.corpus.readers import Chunk, CorpusPlan
from train_deploy.handoffs import TokenizerInfo
from train_deploy.run_control.processes import stop_process_tree

_GRACE = 5.0
"""Seconds a helper has to end after SIGTERM (after an error elsewhere, or once it has sent its statistics)."""


def run_local(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, work: Path) -> list[ChunkResult]:
    """Encode every chunk of ``plan`` into shards in ``work`` with ``workers`` processes; return their statistics."""
    workers = min(config.workers, len(plan.chunks))
    ctx = mp.get_context("spawn")  # no fork: the parent may hold MLflow threads and Paddle state
    progress = (ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0))  # chunks finished, documents, tokens
    cursor = ctx.Value("q", 0)
    claimed = ctx.Array("q", [-1] * workers, lock=False)
    init_args = (config, tokenizer, work, progress, cursor, claimed)
    helpers = _Helpers(ctx, workers - 1, init_args, plan.chunks)  # first: their start-up overlaps this one's
    bar = EncodingProgress(len(plan.chunks), config.encoding.progress)

    def show() -> None:
        bar.show(progress[0].value, progress[1].value, progress[2].value)

    with bar:
        try:
            encoder = ChunkEncoder(config, tokenizer, progress=partial(_bump, progress), watch=helpers.check)
            results = _drain(encoder, work, plan.chunks, cursor, claimed, 0, progress[0], show)
            results += helpers.wait(show)
            show()
        finally:
            helpers.stop()
    return results


def _bump(progress: tuple[Any, Any, Any], documents: int, tokens: int) -> None:
    _, docs_counter, tokens_counter = progress
    with docs_counter.get_lock():
        docs_counter.value += documents
    with tokens_counter.get_lock():
        tokens_counter.value += tokens


def _drain(encoder: ChunkEncoder, work: Path, chunks: list[Chunk], cursor: Any, claimed: Any, slot: int,
           finished: Any, between_chunks: Callable[[], None]) -> list[ChunkResult]:
    """Encode chunks until none is left unclaimed; ``claimed[slot]`` holds the chunk this process is encoding,
    ``finished`` counts the chunks every process has encoded."""
    results = []
    while True:
        with cursor.get_lock():
            index = cursor.value
            cursor.value += 1
            if index < len(chunks):
                claimed[slot] = index
        if index >= len(chunks):
            return results
        result = encoder.encode(chunks[index], work)
        claimed[slot] = -1
        results.append(result.stamp())
        with finished.get_lock():
            finished.value += 1
        between_chunks()


class _Helpers:
    """The spawned helper processes, watched through their result pipes and exit status."""

    def __init__(self, ctx: Any, count: int, init_args: tuple, chunks: list[Chunk]) -> None:
        self._chunks, self._claimed = chunks, init_args[-1]
        self._processes: list[Any] = []
        self._pending: dict[int, tuple[Any, Connection]] = {}
        """Slot → (process, receiving end of its pipe), until it has sent its statistics."""
        self._results: list[ChunkResult] = []
        with _main_module_hidden():
            for slot in range(1, count + 1):
                receiver, sender = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_help, args=(slot, init_args, chunks, sender, os.getpid()),
                                      name=f"corpus-helper-{slot}", daemon=True)
                process.start()
                sender.close()  # the helper holds the only writing end: its death reads as end of file
                self._processes.append(process)
                self._pending[slot] = (process, receiver)

    def check(self) -> None:
        """Take the statistics of helpers that finished; raise a helper's error, or its death. A few µs."""
        for slot, (process, receiver) in list(self._pending.items()):
            if receiver.poll() or process.exitcode is not None:
                self._receive(slot)

    def wait(self, tick: Callable[[], None]) -> list[ChunkResult]:
        """Wait for every helper's statistics (``tick`` twice a second), then for the helpers to exit; raise as
        :meth:`check` does."""
        while self._pending:
            wait([w for process, receiver in self._pending.values() for w in (receiver, process.sentinel)], 0.5)
            tick()
            self.check()
        for process in self._processes:
            process.join(_GRACE)  # it sent its statistics: nothing is left but exiting
        return self._results

    def stop(self) -> None:
        """End every helper still running (after an error, the others' work is of no use), and its children."""
        for process in self._processes:
            if process.exitcode is None:
                stop_process_tree(process.pid, _GRACE)
            process.join(_GRACE)
        for _, receiver in self._pending.values():
            receiver.close()

    def _receive(self, slot: int) -> None:
        process, receiver = self._pending.pop(slot)
        try:
            results, error = receiver.recv()
        except (EOFError, OSError):  # it died before it could send anything, or while sending
            raise self._death(slot, process) from None
        finally:
            receiver.close()
        if error is not None:
            raise error  # the helper's own exception: a CorpusError keeps its one-line message
        self._results += results

    def _death(self, slot: int, process: Any) -> CorpusError:
        process.join(5)  # the end of file can arrive a moment before the exit status
        code = process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"signal {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"
        position = self._claimed[slot]
        where = "while holding no chunk" if position < 0 else f"while encoding {chunk_place(self._chunks[position])}"
        return CorpusError(f"corpus helper {process.pid} died ({how}) {where}; nothing was published")


def _help(slot: int, init_args: tuple, chunks: list[Chunk], sender: Connection, parent: int) -> None:
    """A helper process: encode chunks until none is left, then send the parent their statistics or the error."""
    try:
        config, tokenizer, work, progress, cursor, claimed = init_args
        encoder = ChunkEncoder(config, tokenizer, progress=partial(_bump, progress))
        sender.send((_drain(encoder, work, chunks, cursor, claimed, slot, progress[0],
                            lambda: _exit_if_orphaned(parent)), None))
    except Exception as exc:
        exc.add_note(f"in corpus helper {os.getpid()}:\n{''.join(traceback.format_exception(exc))}")
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        sender.send((None, exc))


def _exit_if_orphaned(parent: int) -> None:
    """A helper whose parent was killed stops instead of encoding into a folder nobody will publish."""
    if os.getppid() != parent:
        raise SystemExit(f"corpus helper {os.getpid()}: parent {parent} is gone")


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawned helpers normally import the parent's main module first: under ``kedro run`` that is the Kedro
    CLI (~0.35 s of imports before a helper can take a chunk). They only run this package's functions, so
    the main module's path and spec are hidden from ``multiprocessing`` while the helpers start."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)
