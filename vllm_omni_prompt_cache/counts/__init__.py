"""The counts: one table of counters every call adds to (``counters``), and the snapshot of counts and
levels that ``stats()``, ``/metrics``, the log line and ``check`` show (``stats``).

May import ``keys`` and the base modules; nothing above.
"""
