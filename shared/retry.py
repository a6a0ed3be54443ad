"""The retry policies: exponential backoff with jitter.

:func:`retrying` is bounded twice and is for operations; :func:`reconnecting`
never gives up and is for a link that must come back by itself.

Retries stop after ``attempts`` tries or once the next wait would pass
``total`` seconds, whichever comes first, and only for
:class:`~shared.errors.TransientError`; NotFound, PreconditionFailed,
InvalidArgument and every other error pass through at once. Use it only
around idempotent operations (or ones carrying an idempotency key).

::

    async for attempt in retrying("store.get"):
        with attempt:
            data = await inner.get(key)

    @retry_async("link.connect", attempts=10, total=120)
    async def connect() -> None: ...
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Final, ParamSpec, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential_jitter,
    wait_random_exponential,
)

from shared.errors import InvalidArgument, TransientError

__all__ = [
    "DEFAULT_ATTEMPTS",
    "DEFAULT_MAX_DELAY",
    "DEFAULT_TOTAL",
    "reconnecting",
    "retry_async",
    "retrying",
]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

#: Tries in all (the first call included).
DEFAULT_ATTEMPTS: Final = 5
#: Seconds of the first wait; each next one doubles, plus up to as much jitter.
DEFAULT_INITIAL: Final = 0.2
#: The longest single wait, in seconds.
DEFAULT_MAX_DELAY: Final = 5.0
#: Seconds after the first try beyond which no retry starts.
DEFAULT_TOTAL: Final = 30.0


def _log_retry(op_name: str) -> Callable[[RetryCallState], None]:
    def log(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        # The error class and our own message only: our messages carry no secrets.
        logger.warning(
            "%s failed (attempt %d), retrying in %.2fs: %s: %s",
            op_name,
            state.attempt_number,
            wait,
            type(error).__name__,
            error,
        )

    return log


def retrying(
    op_name: str,
    *,
    attempts: int = DEFAULT_ATTEMPTS,
    initial: float = DEFAULT_INITIAL,
    max_delay: float = DEFAULT_MAX_DELAY,
    total: float = DEFAULT_TOTAL,
) -> AsyncRetrying:
    """Return a tenacity ``AsyncRetrying`` applying the policy to ``op_name``.

    Iterate it (``async for attempt in ...: with attempt: ...``) or call it
    (``await retrying("op")(fn, *args)``). The last error is re-raised as is
    when retries run out.
    """
    if attempts < 1:
        raise InvalidArgument("attempts", "must be at least 1")
    if initial < 0 or max_delay < 0 or total <= 0:
        raise InvalidArgument("total", "delays must be >= 0 and total > 0")
    return AsyncRetrying(
        stop=stop_after_attempt(attempts) | stop_before_delay(total),
        wait=wait_exponential_jitter(multiplier=initial, max=max_delay, jitter=initial),
        retry=retry_if_exception_type(TransientError),
        before_sleep=_log_retry(op_name),
        reraise=True,
    )


def reconnecting(
    *,
    retry_on: Callable[[BaseException], bool],
    initial: float,
    max_delay: float,
    before_sleep: Callable[[RetryCallState], Awaitable[None] | None],
    sleep: Callable[[float], Awaitable[None]],
) -> AsyncRetrying:
    """The policy for a link that must come back by itself: retry forever.

    Full jitter (a random wait up to ``initial * 2**n``, capped at ``max_delay``)
    spreads a fleet of machines reconnecting to a restarted control plane. The
    caller decides what is worth retrying (``retry_on``) and supplies a
    ``sleep`` its shutdown can interrupt.
    """
    if initial <= 0 or max_delay < initial:
        raise InvalidArgument("initial", "need 0 < initial <= max_delay")
    return AsyncRetrying(
        wait=wait_random_exponential(multiplier=initial, max=max_delay),
        retry=retry_if_exception(retry_on),
        before_sleep=before_sleep,
        sleep=sleep,
        reraise=True,
    )


def retry_async(
    op_name: str,
    *,
    attempts: int = DEFAULT_ATTEMPTS,
    initial: float = DEFAULT_INITIAL,
    max_delay: float = DEFAULT_MAX_DELAY,
    total: float = DEFAULT_TOTAL,
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Decorate an async function so each call runs under :func:`retrying`."""

    def decorate(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            policy = retrying(
                op_name, attempts=attempts, initial=initial, max_delay=max_delay, total=total
            )
            async for attempt in policy:
                with attempt:
                    return await fn(*args, **kwargs)
            raise AssertionError("unreachable: tenacity re-raises the last error")

        return wrapper

    return decorate
