"""Shared infrastructure: atomic writes, lazy package faces, periodic tasks, the HTTP layer, multi-host start-up."""
