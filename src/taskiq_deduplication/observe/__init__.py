"""What the library tells: lock events, metrics, send spans and refusal lines.

`events.py` defines the lock events and delivers them to subscribers;
`metrics.py` records the Prometheus metrics from them; `tracing.py` annotates
a send's span; `refusals.py` logs a refused call (the
``taskiq_deduplication.refusals`` logger).
"""
