"""Feed: a tf.data iterator (plain or distributed) owned for its lifetime and released without waiting.

Why not let Python drop an iterator where it goes out of scope: TensorFlow's iterator destructor can
block its thread for up to a minute with nothing left to do. Each iterator's root (RootDataset) runs
an autotuning thread that sleeps between optimisations, the sleep doubling up to 60 s as the
iterator lives on. The destructor cancels that thread and joins it; the cancellation wakes it, but
TensorFlow marks the cancellation as done only after the wake-up call returns
(tsl::CancellationManager::StartCancel), so a woken thread that runs first sees "not cancelled" and
sleeps out the rest of its period (tensorflow::data::model::Model::OptimizeLoop). On idle cores the
destroying thread nearly always gets there first; on busy ones the woken thread often does
(docs/PERFORMANCE.md, "Last line to exit"; a distributed iterator on N towers is N + 1 such
iterators). The destructor also waits for decode calls in flight, which a stop mid-stream (an error,
a signal) leaves behind.

So the last reference to the iterator is dropped on a thread of its own (`release`): the destructor
cancels the pipeline's work at once and waits there, while the command goes on and ends (a command
ends its process with os._exit, seg_train/cli/process.py, which does not wait for that thread). The iterator
is released when its stream is exhausted, on `close()`, or when the Feed itself is dropped (any way
out, an exception included): the Feed is the only owner of the iterator, and the frames of an
exception raised by the iterator, which hold it as a local, are cleared before the exception leaves
`__next__`.
"""

from __future__ import annotations

import atexit
import threading
import traceback

_releasing: set[threading.Thread] = set()  # release threads not finished yet
JOIN_TIMEOUT_S = 300  # at interpreter exit, per release still running (TensorFlow's wait is at most ~60 s)


def release(box: list) -> None:
    """Empties `box` on a thread of its own, so that objects only the box holds are destroyed there.

    The caller must hold no other reference to them (pass them inside the list, not as a local).
    """
    def drop():
        box.clear()
        _releasing.discard(threading.current_thread())

    thread = threading.Thread(target=drop, name="seg-train-release", daemon=True)
    try:
        _releasing.add(thread)
        thread.start()
    except RuntimeError:  # interpreter shutdown: no new threads; drop them here
        _releasing.discard(thread)
        box.clear()


@atexit.register
def _join_releases() -> None:
    """At the exit of a process that Python tears down (an in-process caller, e.g. the tests), waits for
    the releases still running: Python ends a thread that asks for the GIL once its tear-down has begun,
    and a release thread asks for it on its way out of TensorFlow's destructor, where being ended
    aborts the process ("FATAL: exception not rethrown"). A command never waits here: registered when
    seg_train/cli/process.py is imported, this hook runs after the command's own one (_end_process), which
    ends the process first."""
    for thread in list(_releasing):
        thread.join(JOIN_TIMEOUT_S)


def _clear_frames(exc: BaseException) -> None:
    """Clears the locals of the finished frames of `exc`'s traceback and of its cause and context."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # skips frames still executing (this one's callers)
        exc = exc.__cause__ or exc.__context__


class Feed:
    """iter(dataset), owned: iterate it, `close()` it (or use it in a `with`); never waits for its end.

    Args:
      dataset: a tf.data.Dataset or a distributed dataset (strategy.distribute_datasets_from_function).
    """

    def __init__(self, dataset):
        self._it = iter(dataset)

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            raise StopIteration
        try:
            return next(self._it)
        except BaseException as e:
            # TensorFlow's frames below this one hold the iterator: clear them so that only this Feed does.
            _clear_frames(e)
            if isinstance(e, StopIteration):
                self.close()
            raise

    def close(self) -> None:
        """Releases the iterator (module doc): its work is cancelled; nothing waits for it."""
        if getattr(self, "_it", None) is not None:
            box, self._it = [self._it], None
            release(box)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown (module globals gone): nothing left to wait for
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
