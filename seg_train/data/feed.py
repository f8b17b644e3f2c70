"""Feed: a tf.data iterator (plain or distributed) owned for its lifetime and released without waiting.

TensorFlow's iterator destructor can block for up to a minute: a race in cancelling the autotuning
thread can leave it sleeping out its period, and it also waits for decode calls in flight. So the last
reference is dropped on a thread of its own (`release`) while the command goes on and ends (with
os._exit, which does not wait). The Feed is the iterator's only owner: it is released when exhausted,
on `close()`, or when the Feed is dropped; an exception's frames, which hold it, are cleared in `__next__`.
"""

from __future__ import annotations

import atexit
import threading
import traceback

_releasing: set[threading.Thread] = set()  # release threads not finished yet
JOIN_TIMEOUT_S = 300  # at interpreter exit, per release still running (TensorFlow's wait is at most ~60 s)


def release(box: list) -> None:
    """Empties `box` on a thread of its own, so objects only the box holds are destroyed there (the
    caller must hold no other reference: pass them inside the list, not as a local)."""
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
    """At the exit of a process Python tears down (e.g. the tests), waits for releases still running: a
    release thread ended during tear-down aborts the process. A command never waits here: its own exit
    hook runs first and ends the process."""
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
    """iter(dataset) (plain or distributed), owned: iterate it, `close()` it (or use it in a `with`);
    never waits for its end."""

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
