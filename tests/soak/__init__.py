"""A chaos soak with an outside observer: ``python -m tests.soak --seconds 60``.

Real ``taskiq worker`` processes on two real brokers (taskiq-redis'
``ListQueueBroker`` and RabbitMQ through taskiq-aio-pika), a client that sends
a stream of calls with a share of duplicates, random faults for a set
duration, and a ledger in PostgreSQL where every run writes its start and end.
After the run the ledger is checked; see ``docs/reliability.md``.

Not part of the pytest suite: no module here is named ``test_*``.
"""
