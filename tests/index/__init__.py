"""Tests of the router-side prefix index (``pagedkv.index``) and its service."""
