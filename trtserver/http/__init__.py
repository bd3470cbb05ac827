"""The HTTP layer, the only package that imports aiohttp: the app and its routes (``app``), SSE and
deadlines (``sse``), running and draining the server (``run``), metrics and the OpenAPI document."""
