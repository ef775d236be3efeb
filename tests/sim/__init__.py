"""Tests of the simulator (``pagedkv.sim``) and the ``pagedkv`` CLI that drives it."""
