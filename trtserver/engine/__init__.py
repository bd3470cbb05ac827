"""Engines: the contract (``base``) and the implementations, each imported only when chosen."""
