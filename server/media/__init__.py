"""Image inputs of the chat APIs: bytes from data URLs, base64 and ``file://`` paths, each
bounded before any decoder sees it (``image_inputs``), and a request's image work: whose
caches it may read, how many pixels it may decode, and on which lane (``media_scope``).
libmtmd itself (decoding, encoding) is ``server.llama.mtmd``."""
