"""Monitoring: the metrics endpoint, the table gauges and the operator's read-only reports.

```python
from inbox_middleware.metrics import serve

server = serve(9464, engine=engine)  # /metrics: the samples and the table gauges
```

`serve` (or ``inbox-middleware metrics serve``) serves the samples every worker records
and the gauges read from the inbox tables; `snapshot` is what ``inbox-middleware status``
prints, `explain` what ``inbox-middleware explain`` prints, and `shadow_verdict` the
verdict a shadow run records.
"""

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
from ._operate.status import snapshot
from ._storage.executors import shadow_verdict

__all__ = [
    "MAX_LABEL_VALUES",
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
