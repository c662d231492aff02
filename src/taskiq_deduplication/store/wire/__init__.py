"""A batch of script calls on the wire, and its replies.

`connection.py` writes a batch on one of redis-py's connections and reads the
replies: through redis-py's public API (the reference), or on the lean path,
which uses a few of its private names, checked by `probe.py` before use, and
parses replies with `resp.py`.
"""
