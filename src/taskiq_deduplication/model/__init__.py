"""What a lock is made of, with no I/O: policies, options and labels, keys and values.

`policies.py` has one row per ``deduplication_until`` value (what each step of
a send and a run does to the lock); `settings.py` reads every option and label,
each with one parser for both; `fingerprint.py` makes a call's fingerprint and
`keys.py` the key a call takes; `formats.py` builds and parses every key, value,
token and label the library writes (nowhere else).
"""
