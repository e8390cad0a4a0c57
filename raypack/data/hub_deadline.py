"""One deadline for every Hugging Face Hub request a command makes while it lists its datasets.

    with within_deadline():             # a command's listing: every request below shares it
        info = answer(lambda timeout: api.dataset_info(repo, timeout=timeout), label)

A hub that doesn't answer must fail the command in one line within 30 s of its start, under
load too (docs/guides/data.md). A timeout per request can't promise that: a listing makes one to
three requests a dataset, a mixture names several datasets, and httpx's timeout bounds each read,
not a request (a server that trickles a byte every few seconds never trips it), nor the name
lookup before it. So each request runs in a thread that the caller waits for at most the time
left of one deadline, `DEADLINE_S` from the scope's first request; a request still out then is
left to end on its own (it has the same time as its timeout, and the thread is a daemon, which an
exiting command doesn't wait for). huggingface_hub's own timeouts don't add to it: its listing
calls raypack makes (`dataset_info`, `get_hf_file_metadata`) retry nothing, and the timeout they
get is the time left, not HF_HUB_ETAG_TIMEOUT or HF_HUB_DOWNLOAD_TIMEOUT; the request
huggingface_hub makes of its own while building the first one's headers (its registry of agent
harnesses, `/api/agent-harnesses`, once a day, with a 3 s timeout) runs inside that request's
thread, so inside the deadline too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from contextvars import ContextVar
from typing import Callable, Iterator, TypeVar

from raypack.errors import SourceError

DEADLINE_S = 15.0
"""Seconds all of a command's hub requests may take together. A listing is a few small JSON or
HEAD requests that the hub answers in well under a second each; 15 s leaves the command's start
(its interpreter and the config: about 0.5 s, a few seconds on a loaded machine) and its one-line
exit well inside the 30 s a refused input may take."""

T = TypeVar("T")
_deadline: ContextVar[float | None] = ContextVar("raypack_hub_deadline", default=None)


@contextlib.contextmanager
def within_deadline() -> Iterator[None]:
    """Every `answer` in the block shares one deadline, set by the outermost scope: a command's
    early listing (raypack/cli.py) holds one for all its datasets, a lone `hub_files` its own."""
    if _deadline.get() is not None:
        yield
        return
    token = _deadline.set(time.monotonic() + DEADLINE_S)
    try:
        yield
    finally:
        _deadline.reset(token)


def answer(call: Callable[[float], T], label: str, endpoint: str) -> T:
    """`call(timeout)`, one hub request, if it answers before the deadline; a SourceError naming
    `label` and the unanswering `endpoint` if it doesn't. Its own exceptions are raised as they are
    (raypack/data/hub.py says what they mean), a timeout among them as the deadline's line."""
    deadline = _deadline.get()
    left = DEADLINE_S if deadline is None else deadline - time.monotonic()
    done: dict[str, object] = {}

    def request() -> None:
        try:
            done["value"] = call(max(left, 0.01))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            done["error"] = e

    if left > 0:
        thread = threading.Thread(target=request, name="raypack-hub-request", daemon=True)
        thread.start()
        thread.join(left)
    if "value" in done:
        return done["value"]  # type: ignore[return-value]
    error = done.get("error")
    if error is None or _timed_out(error):  # still out at the deadline, or its timeout (the time left) ran out
        raise SourceError(f"{label}: can't reach the hub at {endpoint} (no answer within {DEADLINE_S:g} s; "
                          "HF_HUB_OFFLINE=1 reads the hub cache)") from error
    raise error


def _timed_out(e: BaseException) -> bool:
    """httpx's timeouts (connect, read, write, pool), and the standard library's."""
    return isinstance(e, TimeoutError) or (type(e).__module__.startswith(("httpx", "httpcore"))
                                           and "Timeout" in type(e).__name__)
