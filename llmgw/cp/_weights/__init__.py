"""The weights wing: the mirror (its pure request, range and index logic in
`_paths.py`, its connection loop in `_mirror.py`), each fetched source's measured
size (`_sizes.py`), and what each node holds on disk (`_holdings.py`). It imports
only from below the control plane (llmgw.core, llmgw.config, llmgw.model, llmgw.web)."""
