"""Running a model: decoding (``decode``, ``plait generate``)."""
