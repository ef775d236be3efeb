"""Tests of the manager's KV events, their wire format and their ZMQ transport."""
