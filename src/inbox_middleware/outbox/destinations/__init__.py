"""The destinations shipped with the outbox, each in its own module so that importing
one needs only its own optional library:

- `inbox_middleware.outbox.destinations.http.HttpDestination` (extra ``http``)
- `inbox_middleware.outbox.destinations.dramatiq.DramatiqDestination` (extra ``dramatiq``)
- `inbox_middleware.outbox.destinations.faststream.FastStreamDestination`
  (extra ``faststream``)
"""

__all__: list[str] = []
