"""Scripts every process of a job runs: ``test_script`` (``hasten test``'s self-check), ``test_ops`` (the
operations of ``accelerate.utils``) and ``test_sync`` (gradient synchronisation); importable as modules, whose
``main`` ``debug_launcher`` can start."""
