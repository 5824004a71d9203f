"""The contract suite: CONTRACT.md clause by clause (see ``tests/conftest.py``)."""
