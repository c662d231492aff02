"""The locks page: an ASGI app that lists, shows and releases locks in a browser.

`app.py` is the application (routes, form tokens, the ``authorize`` hook, the
JSON view); `pages.py` its HTML, every text escaped; `static/` its script and
style. It uses the public lock API only. Needs the extra ``[web]``.
"""

from taskiq_deduplication.web.app import Action, Authorize, allow_anyone, locks_app

__all__ = ["Action", "Authorize", "allow_anyone", "locks_app"]
