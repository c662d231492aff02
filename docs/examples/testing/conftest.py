"""The conftest.py at the root of the application's tests."""

# --8<-- [start:plugin]
pytest_plugins = ["taskiq_deduplication.testing"]
# --8<-- [end:plugin]
