"""Operator and developer tools outside the data path: the ``remoteloader`` command line
(``cli``), the synthetic table generator (``datagen``) and the demo training loop (``demo``)."""
