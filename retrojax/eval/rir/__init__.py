"""RIR evaluation: per-variant metrics with intervals and paired differences (``metrics``), the
``retrojax eval`` hook for RIR protocol names (``run``), and the paper-style report of ``retrojax rir``
(``report``)."""
