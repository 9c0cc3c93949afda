"""transformers integration: one patcher (``patcher.py``, with the rows it applies in ``rows.py``, its records
in ``records.py`` and its report in ``report.py``), one map of rows per model family (``qwen3_5.py``,
``qwen3_5_moe.py``, ``qwen3_next.py``) and the op adapters they route to. The maps are assembled, with those
of the libraries built on transformers (``deltafuse.integrations.trl``, ``deltafuse.integrations.peft``), in
``deltafuse.maps``, which also holds the process's ``PATCHER``; this package imports nothing on import."""
