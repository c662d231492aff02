"""A run of a locked task, from ``pre_execute`` to ``post_execute``, and what keeps it alive.

`runs.py` does what the run's policy says at its start (claim its run slot,
wait, take merged arguments, draw its fence) and at its end; `log.py` says how a
run began (its log lines and lock events); `execution.py` is what the process
knows of a run while it goes on; `copies.py` answers a delivery that must not
run its body; `heartbeat.py` keeps running tasks' locks alive; `loops.py` holds
the Redis client, lock store and heartbeat of each event loop.
"""
