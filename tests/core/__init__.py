"""Tests of the manager through the Python wrapper: specs, hashing, allocation, errors."""
