"""A chaos soak with an outside observer: ``python -m tests.soak --seconds 60``.

Real ``taskiq worker`` processes on four real brokers (taskiq-redis'
``ListQueueBroker`` and ``RedisStreamBroker`` with a short ``idle_timeout``,
RabbitMQ through taskiq-aio-pika, NATS JetStream through taskiq-nats with a
short ``ack_wait``), a client that sends a stream of calls under every lock
policy (merge and debounce too) with a share of duplicates and of calls that
outlast those timeouts, random faults for a set duration, and a ledger in
PostgreSQL where every run writes its start and end.
After the run the ledger is checked; see ``docs/reliability.md``.

Not part of the pytest suite: no module here is named ``test_*``.
"""
