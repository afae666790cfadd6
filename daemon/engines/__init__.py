"""Telling the local inference engines: the hooks (none, http, command, vLLM), engine first
(a verified version reaches the engines as a patch before the disk), and the vLLM backend hook."""
