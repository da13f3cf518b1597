"""The observation wing: what happened (`_events.py`, the event log), each node's
last hour (`_history.py`) and the nodes' logs read through the agents
(`_node_logs.py`). It keeps no fleet state of its own and imports no other wing."""
