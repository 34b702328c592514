"""HTTP POST with an ``Idempotency-Key`` header (httpx; ``pip install inbox-middleware[http]``).

The remote is expected to apply a request once per key and to answer a repeated key with
the first answer, as payment and messaging APIs do: that is what turns the dispatcher's
at-least-once delivery into one effect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._core.optional import require

require("httpx", "http")

import httpx  # noqa: E402

from .._destination import Effect  # noqa: E402
from .._errors import DeliveryError, PermanentDeliveryError  # noqa: E402

__all__ = ["RETRYABLE_STATUSES", "HttpDestination"]

RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})
"""4xx answers worth retrying (timeout, a concurrent request with the same key, too
early, too many requests); every 5xx is retried too, any other 4xx fails at once."""

_MAX_BODY = 2000


class HttpDestination:
    """POST each effect's payload as JSON to ``url``.

    Parameters:
      url: where to POST.
      headers: headers sent with every request; the effect's headers are added to them.
      client: an `httpx.AsyncClient` to use (you close it); by default the destination
        opens its own and closes it when the dispatcher stops.
      idempotency_header: the header carrying the effect id.

    A 2xx answer dispatches the effect; its status and body are the recorded result.
    A timeout is ambiguous and retried with the same key; see `RETRYABLE_STATUSES`.
    """

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        idempotency_header: str = "Idempotency-Key",
    ) -> None:
        self.url = url
        self.headers = dict(headers or {})
        self.idempotency_header = idempotency_header
        self._client = client
        self._owned: httpx.AsyncClient | None = None

    async def deliver(self, effect: Effect, timeout: float) -> dict[str, Any]:
        client = self._client or self._own_client()
        headers = {**self.headers, **effect.headers, self.idempotency_header: effect.effect_id}
        try:
            response = await client.post(
                self.url, json=effect.payload, headers=headers, timeout=timeout
            )
        except httpx.TimeoutException as exc:
            # The request may have been applied: the dispatcher retries it as ambiguous.
            raise TimeoutError(f"{type(exc).__name__} from {self.url}") from exc
        except httpx.HTTPError as exc:
            raise DeliveryError(f"{type(exc).__name__} from {self.url}: {exc}") from exc
        result = {"status": response.status_code, "body": _body(response)}
        if response.is_success:
            return result
        error = f"HTTP {response.status_code} from {self.url}"
        if response.status_code >= 500 or response.status_code in RETRYABLE_STATUSES:
            raise DeliveryError(error, result=result)
        raise PermanentDeliveryError(error, result=result)

    def _own_client(self) -> httpx.AsyncClient:
        if self._owned is None:
            self._owned = httpx.AsyncClient()
        return self._owned

    async def aclose(self) -> None:
        if self._owned is not None:
            owned, self._owned = self._owned, None
            await owned.aclose()


def _body(response: httpx.Response) -> Any:
    if "json" in response.headers.get("content-type", ""):
        try:
            return response.json()
        except ValueError:
            pass
    return response.text[:_MAX_BODY]
