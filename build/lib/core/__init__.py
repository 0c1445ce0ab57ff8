"""The shared vocabulary at the bottom: records every stage passes, validation helpers, device facts.

Nothing here imports from the rest of the project; `sandbox/`, `templates/` and `agent/` all build on it.
"""
