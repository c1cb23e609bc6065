"""What every role shares: the split plan, spec binding, and the split processor.

``plan`` cuts a table into base splits and an epoch into each rank's share (pure
functions: master, local mode and tests compute the same plan). ``binding`` checks a
spec against its table and compiles the transforms. ``processor`` turns one split into
its pieces (read, sample, shuffle, transform, cut), for workers and local mode alike.
``popularity`` is the log of projected columns that the master writes and the offline
reorder tool reads. ``procs`` keeps child processes from outliving their parent and says where
compiled kernels are cached.

Nothing here imports a role (master, worker, client); the import-linter contract in
pyproject.toml checks it.
"""
