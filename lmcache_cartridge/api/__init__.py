"""Stage 5, the request API: the OpenAI-compatible gateway that places cartridges in front of a
vLLM server, and a small Python client for it.
"""
