"""Task graphs: a request split into nodes that each run where they fit (/v1/tasks)."""
