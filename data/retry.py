"""Retries for reads from the hub (or any remote file): HTTP 429 / 5xx, timeouts, dropped connections.

A failed request is retried after an exponential backoff with full jitter (sleep uniform in
[0, backoff_s * 2**attempt], capped at MAX_BACKOFF_S), at most ``tries`` attempts in all; then a
clear error names the file and the last failure. Other errors (a missing file, a bad schema) are
raised at once: retrying them only delays the message.

The HTTP stacks under HF ``datasets`` and fsspec wrap a failed response in their own exceptions
(fsspec's HTTP filesystem turns a 503 on open into FileNotFoundError from aiohttp's error), so the
whole chain of causes is searched for a status code or a timeout.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BACKOFF_S = 60.0
RETRY_STATUS = frozenset({408, 425, 429}) | frozenset(range(500, 600))


class RemoteReadError(RuntimeError):
    """A remote read that still failed after data.retries attempts."""


def _status(err: BaseException) -> int | None:
    """The HTTP status an exception carries, if any (aiohttp .status, requests/httpx .response.status_code)."""
    for holder in (err, getattr(err, "response", None)):
        if holder is None:
            continue
        for name in ("status", "status_code"):
            value = getattr(holder, name, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
    return None


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def is_retryable(err: BaseException) -> bool:
    """True for HTTP 408/425/429/5xx, timeouts and dropped connections anywhere in err's cause chain.

    Offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) refusing a request is a ConnectionError too,
    but waiting never fixes it."""
    links = list(_chain(err))
    if any("OfflineModeIsEnabled" in f"{type(link).__name__} {link}" for link in links):
        return False
    for link in links:
        status = _status(link)
        if status is not None:
            return status in RETRY_STATUS
        if isinstance(link, (TimeoutError, ConnectionError)):
            return True
        name = type(link).__name__
        # requests.Timeout / ConnectionError, httpx.TimeoutException / RemoteProtocolError,
        # aiohttp.ServerDisconnectedError / ClientConnectionError / ClientPayloadError, ...
        if any(key in name for key in ("Timeout", "Disconnected", "ConnectionError", "PayloadError")):
            return True
        if name in ("RemoteProtocolError", "IncompleteRead", "ChunkedEncodingError"):
            return True
    return False


def with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    tries: int,
    backoff_s: float,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
    failed: BaseException | None = None,
) -> T:
    """fn(), retried on retryable errors up to `tries` attempts in all; RemoteReadError naming `what` after.

    failed: the retryable error of a first attempt the caller already made (it counts as one)."""
    attempt = 0
    while True:
        if failed is None:
            try:
                return fn()
            except Exception as err:
                if not is_retryable(err):
                    raise
                failed = err
        if attempt + 1 >= tries:
            raise RemoteReadError(
                f"reading {what} failed {tries} time(s) in a row, last with {type(failed).__name__}: {failed}. "
                "The host keeps refusing (rate limit, outage or timeouts): retry later, raise "
                "data.retries / data.retry_backoff_s, or use local data (data.source=local or tokens)."
            ) from failed
        rng = rng or random.Random()
        delay = rng.uniform(0, min(MAX_BACKOFF_S, backoff_s * 2**attempt))
        log.warning(
            "data: reading %s failed (%s: %s); retry %d of %d in %.1f s",
            what,
            type(failed).__name__,
            failed,
            attempt + 1,
            tries - 1,
            delay,
        )
        sleep(delay)
        attempt += 1
        failed = None
