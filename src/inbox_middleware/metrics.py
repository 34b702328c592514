"""Monitoring: the metrics endpoint, the table gauges and the operator's read-only reports.

```python
from inbox_middleware._operate.metrics import serve

server = serve(9464, engine=engine)  # /metrics: the samples and the table gauges
```

`serve` (or ``inbox-middleware metrics serve``) serves the samples every worker records
and the gauges read from the inbox tables; `snapshot` is what ``inbox-middleware status``
prints, `explain` what ``inbox-middleware explain`` prints, and `shadow_verdict` the
verdict a shadow run records. ``--json`` output follows `STATUS_SCHEMA` and
`EXPLAIN_SCHEMA`.
"""

from ._operate.explain import SCHEMA as EXPLAIN_SCHEMA
from ._operate.explain import explain
from ._operate.metrics import (
    MAX_LABEL_VALUES,
    Metrics,
    MetricsServer,
    TableCollector,
    label_values,
    metrics,
    serve,
)
from ._operate.status import SCHEMA as STATUS_SCHEMA
from ._operate.status import snapshot
from ._storage.executors import shadow_verdict

__all__ = [
    "EXPLAIN_SCHEMA",
    "MAX_LABEL_VALUES",
    "STATUS_SCHEMA",
    "Metrics",
    "MetricsServer",
    "TableCollector",
    "explain",
    "label_values",
    "metrics",
    "serve",
    "shadow_verdict",
    "snapshot",
]
