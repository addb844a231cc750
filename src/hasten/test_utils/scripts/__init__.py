"""Scripts every process of a job runs: ``test_script`` (``hasten test``'s self-check) and ``test_ops`` (the
operations of ``accelerate.utils``); importable as modules, whose ``main`` ``debug_launcher`` can start."""
