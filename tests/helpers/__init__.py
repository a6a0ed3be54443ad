"""Helpers shared by the test suites (real servers, free ports)."""
