"""``specfw bench`` and ``specfw tune``: prompt sets through the engine in-process or through any
OpenAI-compatible server, at several concurrency levels; one JSON record per run, a summary table
and plots; tuned defaults written for ``specfw serve`` (``core/tuned.py``)."""
