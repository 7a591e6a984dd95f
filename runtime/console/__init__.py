"""The operator's console: ``GET /console`` (``routes``) and the page it serves (``assets/``: plain HTML, CSS and JS,
no build step), which reads the admin API's own JSON in the browser.

Not here: the data it shows (``runtime/admin/``), the learner's standalone report (``learner/report.py``, which inlines
the page's ``charts.js`` and ``console.css``).
"""
