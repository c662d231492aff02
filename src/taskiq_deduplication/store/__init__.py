"""Redis: the lock operations, and everything between them and the socket.

`lock_store.py` holds the lock operations, one owner-checked Lua script each
(`lua/`); `pipeline.py` orders, batches, times out and replays their calls;
`call.py` is one script call; `wire/` writes a batch and reads its replies
(redis-py's public API, or the lean path beside it); `client.py` builds the
client from the options; `scan.py` lists and reads locks as an operator sees
them.
"""
