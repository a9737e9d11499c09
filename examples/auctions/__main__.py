"""``python -m auctions live | replay`` (run from examples/, or with examples/ on PYTHONPATH)."""

from .app import app

app(prog_name="python -m auctions")
