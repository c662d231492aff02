"""A send of a locked task, from ``pre_send`` to ``post_send`` or the broker's refusal.

`plan.py` plans a send once from its labels (its key, the lock a retry carries,
where calls merge, whether it draws a fence); `sends.py` takes its lock and says
what became of it (taken, refused, merged, joined, carried on by a retry, sent
without a lock); `pending.py` remembers each send between its ``pre_send`` and
``post_send``.
"""
