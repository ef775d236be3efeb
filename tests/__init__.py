"""The test suite: the shared helpers (``tests._util``) and one package per layer."""
