"""Speed figures under stable keys: ``retrojax bench <target>``."""
